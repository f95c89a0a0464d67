"""Sampling end to end on the real default model, with and without n-gram speculation.

* a seeded sampled request (temperature 0.8) gives the same tokens on every run and whatever
  else shares its batch (its RNG is its own ``torch.Generator``);
* ``top_k=1`` is greedy whatever the temperature;
* with n-gram speculation, greedy output equals plain decoding token for token, and seeded
  sampling gives valid, reproducible text. (A seeded request's stream is not expected to equal
  the non-speculative one: verification draws extra uniforms from the request's RNG.)
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine import LLM, SamplingParams

# ---------------------------------------------------------------- shared test plumbing
# (Duplicated in each of tests/test_engine_api.py, test_smollm2_vs_hf.py, test_async_llm.py,
# test_cli.py and test_sampling_e2e.py so each file runs on its own.)

ENGINE_OPTS = dict(num_threads=1, kv_cache_memory_bytes=64 << 20, max_model_len=512)


def _default_model_once():
    """The default GGUF read and dequantized once per test process (about 12 s each time saved).

    Kept on the ``engine.loader`` module object so every test file of the process shares it.
    The builder clears the state-dict it is handed, so each engine gets a fresh dict of the same
    (never mutated) tensors.
    """
    import engine.loader as loader
    cached = getattr(loader, "_tests_default_fp32", None)
    if cached is None:
        try:
            cached = loader.load_model_files(None)
        except RuntimeError as exc:  # offline and nothing cached
            pytest.skip(f"default model unavailable: {exc}")
        loader._tests_default_fp32 = cached
    return cached


@contextlib.contextmanager
def reuse_default_weights():
    import engine.builder as builder
    from engine.loader import LoadedModel
    real = builder.load_model_files
    base = _default_model_once()

    def load(model, dtype=torch.float32):
        if model is None and dtype == torch.float32:
            return LoadedModel(base.config, dict(base.state_dict), base.tokenizer, base.source)
        return real(model, dtype=dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "load_model_files", load)
        yield


def assert_all_blocks_free(engine) -> None:
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Repeat after me: red green blue, red green blue, red green blue, red green blue,"]
SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=12, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with reuse_default_weights():
        return LLM(**ENGINE_OPTS)


@pytest.fixture(scope="module")
def spec_llm():
    with reuse_default_weights():
        return LLM(**ENGINE_OPTS, speculative_config={"method": "ngram", "num_speculative_tokens": 4})


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
    assert len(alone) == 12 and all(0 <= t < llm.engine.parts.model_config.vocab_size for t in alone)
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
    assert all(0 <= t < spec_llm.engine.parts.model_config.vocab_size for t in c.token_ids)
    assert c.text == spec_llm.tokenizer.decode(c.token_ids) and c.text.strip()
    assert batch[1].outputs[0].token_ids == c.token_ids
    assert_all_blocks_free(spec_llm.engine)
    stats = spec_llm.get_spec_stats()
    assert stats is not None
