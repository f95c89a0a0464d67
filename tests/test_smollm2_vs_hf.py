"""SmolLM2-135M end to end: tokenbudget's greedy output equals transformers' ``generate``.

The default model (Q4_1 GGUF, dequantized to fp32) runs in ``LLM()`` and, with the very same
state dict, in ``transformers.LlamaForCausalLM`` with ``generate(do_sample=False)``. 32 new
tokens per prompt, EOS ignored on both sides, each prompt alone and all of them in one batch of
mixed prompt lengths.

transformers gets the prompt ids of its own tokenizer, built by transformers from the same GGUF
(``model_helpers.hf_gguf_tokenizer``), never ours: a tokenizer bug cannot pass on both sides.

Prompt choice: tokenbudget's arithmetic is batch invariant, transformers' is not bitwise equal
to ours, so a near-tie in the logits could legitimately flip an argmax. Each run re-checks that
the prompts have no near-tie on their 32 greedy steps (transformers' top-2 logits apart by more
than ``MIN_GAP`` relative; measured once at 2.7e-4 for the village prompt, >= 1.5e-3 for the
others), so a divergence here is a bug to explain, not a tolerance to widen.
"""

from __future__ import annotations

import pytest
import torch

from tokenbudget import LLM, SamplingParams

from engine_fixtures import (  # noqa: E402
    ENGINE_OPTS,
    assert_all_blocks_free,
    default_loaded,
    default_target,
)
from model_helpers import hf_gguf_tokenizer, hf_llama_from_loaded  # noqa: E402

# ---------------------------------------------------------------- fixtures

NEW_TOKENS = 32
MIN_GAP = 1e-4  # relative top-2 logit gap below which an argmax may flip on rounding alone
PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = ["What is the boiling point of water?", "Write a short haiku about the sea, please."]


@pytest.fixture(scope="module")
def llm():
    return LLM(default_target(), dtype="float32", **ENGINE_OPTS)


@pytest.fixture(scope="module")
def prompts(llm) -> list[str]:
    chat = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    return PLAIN + chat


@pytest.fixture(scope="module")
def hf_model():
    base = default_loaded()
    model = hf_llama_from_loaded(base)
    model.generation_config.eos_token_id = None  # run the full 32 tokens, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, from transformers' own tokenization of it; the
    premise (no near-tie on any step) re-checked."""
    torch.set_num_threads(ENGINE_OPTS["num_threads"])
    out = []
    for p in prompts:
        ids = torch.tensor([hf_gguf_tokenizer()(p).input_ids])
        with torch.no_grad():
            gen = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                                    return_dict_in_generate=True)
        top2 = torch.stack(gen.scores)[:, 0].topk(2, dim=-1).values
        gap = ((top2[:, 0] - top2[:, 1]) / top2[:, 0].abs()).min().item()
        assert gap > MIN_GAP, f"{p!r}: a near tie ({gap:.2e}) makes this prompt unfit"
        out.append(gen.sequences[0, ids.shape[1]:].tolist())
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
        assert out.prompt_token_ids == hf_gguf_tokenizer()(p).input_ids
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
