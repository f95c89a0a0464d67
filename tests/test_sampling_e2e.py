"""Sampling end to end on the real default model, with and without n-gram speculation.

* a seeded sampled request (temperature 0.8) gives the same tokens on every run and whatever
  else shares its batch (its RNG is its own ``torch.Generator``);
* ``top_k=1`` is greedy whatever the temperature;
* with n-gram speculation, greedy output equals plain decoding token for token, and seeded
  sampling gives valid, reproducible text. (A seeded request's stream is not expected to equal
  the non-speculative one: verification draws extra uniforms from the request's RNG.)
"""

from __future__ import annotations

import pytest

from tokenbudget import LLM, SamplingParams

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, default_target  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Repeat after me: red green blue, red green blue, red green blue, red green blue,"]
SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=12, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(default_target(), **ENGINE_OPTS)


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(default_target(), **ENGINE_OPTS, speculative_config={"method": "ngram", "num_speculative_tokens": 4})


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_reproducible_across_runs_and_batches(llm) -> None:
    (alone,) = _tokens(llm.generate(PROMPTS[0], SEEDED, use_tqdm=False))
    (again,) = _tokens(llm.generate(PROMPTS[0], SEEDED, use_tqdm=False))
    assert alone == again
    # Same request in a batch, at a different position, next to an unseeded sampled request,
    # a greedy one and a differently seeded one.
    mixed = llm.generate(
        [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[0]],
        [SamplingParams(temperature=1.0, max_tokens=12), GREEDY, SEEDED,
         SamplingParams(temperature=0.8, seed=99, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    assert len(alone) == 12 and all(0 <= t < llm.engine.model_config.vocab_size for t in alone)
    assert_all_blocks_free(llm.engine)


def test_top_k_1_is_greedy(llm) -> None:
    greedy = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    top1 = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=12,
                                                        ignore_eos=True), use_tqdm=False))
    assert top1 == greedy
    assert_all_blocks_free(llm.engine)


def test_ngram_greedy_equals_plain(llm, spec_llm) -> None:
    plain = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    spec = spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(spec) == _tokens(plain)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    assert spec[2].metrics.num_draft_tokens > 0 and spec[2].metrics.num_accepted_tokens > 0
    assert_all_blocks_free(spec_llm.engine)


def test_ngram_seeded_sampling_valid_and_reproducible(spec_llm) -> None:
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    (alone,) = spec_llm.generate(PROMPTS[2], params, use_tqdm=False)
    batch = spec_llm.generate([PROMPTS[0], PROMPTS[2]], [SEEDED, params], use_tqdm=False)
    c = alone.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 12
    assert all(0 <= t < spec_llm.engine.model_config.vocab_size for t in c.token_ids)
    assert c.text == spec_llm.tokenizer.decode(c.token_ids) and c.text.strip()
    assert batch[1].outputs[0].token_ids == c.token_ids
    assert_all_blocks_free(spec_llm.engine)
    stats = spec_llm.get_spec_stats()
    assert stats.num_drafts > 0  # the n-gram drafter proposed: the seeded path ran through verification
