"""SmolLM2-135M end to end: tokenbudget's greedy output equals transformers' ``generate``.

The default model (Q4_1 GGUF, dequantized to fp32) runs in ``LLM()`` and, with the very same
state dict, in ``transformers.LlamaForCausalLM`` with ``generate(do_sample=False)``. 32 new
tokens per prompt, EOS ignored on both sides, each prompt alone and all of them in one batch of
mixed prompt lengths.

Prompt choice: tokenbudget's arithmetic is batch invariant, transformers' is not bitwise equal
to ours, so a near-tie in the logits could legitimately flip an argmax. The prompts below were
checked to have no near-tie on their 32 greedy steps: the smallest relative gap between
transformers' top-2 logits is 2.7e-4 (the village prompt; the others >= 1.5e-3), so a
divergence here is a bug to explain, not a tolerance to widen.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

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


# ---------------------------------------------------------------- fixtures

NEW_TOKENS = 32
PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = ["What is the boiling point of water?", "Write a short haiku about the sea, please."]


@pytest.fixture(scope="module")
def llm():
    with reuse_default_weights():
        return LLM(dtype="float32", **ENGINE_OPTS)


@pytest.fixture(scope="module")
def prompts(llm) -> list[str]:
    chat = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    return PLAIN + chat


@pytest.fixture(scope="module")
def hf_model():
    base = _default_model_once()
    c = base.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.resolved_head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(base.state_dict, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    model.generation_config.eos_token_id = None  # run the full 32 tokens, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy(hf_model, llm, prompts) -> list[list[int]]:
    """transformers' greedy tokens for each prompt (same prompt token ids as the engine's)."""
    torch.set_num_threads(ENGINE_OPTS["num_threads"])
    out = []
    for p in prompts:
        ids = torch.tensor([llm.tokenizer.encode(p, add_special_tokens=True)])
        with torch.no_grad():
            gen = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def batch_outputs(llm, prompts):
    return llm.generate(prompts, GREEDY, use_tqdm=False)


# ---------------------------------------------------------------- tests


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_batch_matches_hf(batch_outputs, hf_greedy, prompts, llm) -> None:
    assert len({len(o.prompt_token_ids) for o in batch_outputs}) == len(prompts)  # mixed lengths
    for p, out, ref in zip(prompts, batch_outputs, hf_greedy):
        got = out.outputs[0].token_ids
        assert len(got) == NEW_TOKENS and out.outputs[0].finish_reason == "length"
        assert got == ref, (f"{p!r} diverges from transformers at token {_first_divergence(got, ref)}: "
                            f"{llm.tokenizer.decode(got)!r} vs {llm.tokenizer.decode(ref)!r}")
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("index", range(len(PLAIN) + len(CHAT)))
def test_alone_matches_hf_and_batch(llm, prompts, hf_greedy, batch_outputs, index) -> None:
    (out,) = llm.generate(prompts[index], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy[index]
    assert out.outputs[0].token_ids == batch_outputs[index].outputs[0].token_ids
    assert out.outputs[0].text == batch_outputs[index].outputs[0].text
    assert_all_blocks_free(llm.engine)
