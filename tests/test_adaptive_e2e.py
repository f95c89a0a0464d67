"""The adaptive draft length end to end: it only changes how many drafts are verified.

On the default model, greedy outputs with ``num_speculative_tokens="auto"`` equal plain decoding
token for token; the chosen-k distribution is reported; per-request control through
``SamplingParams.num_speculative_tokens`` disables or caps a request's drafts.
"""

from __future__ import annotations

import pytest

from tokenbudget import LLM, SamplingParams

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, default_target

EDIT = ("Rewrite this function so it skips negative numbers:\n```python\ndef total(xs):\n"
        "    result = 0\n    for x in xs:\n        result += x\n    return result\n```")
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def engines():
    plain = LLM(default_target(), **ENGINE_OPTS)
    auto = LLM(default_target(), **ENGINE_OPTS,
               speculative_config={"method": "ngram", "num_speculative_tokens": "auto"})
    return plain, auto


def _prompts(llm) -> list[str]:
    return PROMPTS + [llm.tokenizer.apply_chat_template([{"role": "user", "content": EDIT}])]


def test_auto_greedy_equals_plain(engines) -> None:
    plain, auto = engines
    params = SamplingParams(max_tokens=48, temperature=0)
    want = [o.outputs[0].token_ids for o in plain.generate(_prompts(plain), params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in auto.generate(_prompts(auto), params, use_tqdm=False)]
    assert got == want
    stats = auto.get_spec_stats()
    assert sum(stats.k_histogram.values()) > 0, "the controller chose no k at all"
    assert all(0 <= k <= auto.engine.speculator.max_k for k in stats.k_histogram)
    assert_all_blocks_free(auto.engine)


def test_per_request_speculation_control(engines) -> None:
    _, auto = engines
    prompt = _prompts(auto)[-1]
    off = auto.generate([prompt], SamplingParams(max_tokens=32, temperature=0, num_speculative_tokens=0),
                        use_tqdm=False)[0]
    assert off.metrics.num_draft_tokens == 0
    capped = auto.generate([prompt], SamplingParams(max_tokens=32, temperature=0, num_speculative_tokens=1),
                           use_tqdm=False)[0]
    assert capped.metrics.num_draft_tokens <= capped.metrics.num_draft_steps  # at most 1 per step
    assert capped.outputs[0].token_ids == off.outputs[0].token_ids


def test_the_engine_teaches_the_cost_model_its_own_steps(engines) -> None:
    """Every committed step's shape and wall time reach the controller's cost model, which stays
    a non-negative fit that predicts the steps it saw to within the machine's noise."""
    import numpy as np

    from tokenbudget.spec.step_shape import step_shape

    _, auto = engines
    core = auto.engine.core
    model = core.speculator.controller.cost_model
    seen = []
    execute = core.runner.execute

    def recording(sched):
        seen.append(step_shape(sched))
        return execute(sched)
    core.runner.execute = recording
    try:
        before = model.num_updates
        auto.generate(_prompts(auto), SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    finally:
        core.runner.execute = execute
    assert model.num_updates - before == len(seen) > 0
    assert np.all(model.weights >= 0)
    assert all(model.cost(s) > 0 for s in seen)
