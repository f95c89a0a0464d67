"""The families on the C kernels (issue 39 item 2): where the C decoder forward runs a family's
switches (q/k norms per head and over the projection, post norms, partial rotary, the attention
scale, the residual multiplier, the embedding multiplier around it, sliding windows, the attention
soft-cap, GeGLU), it is installed, it computes what the torch forward computes over the same
int8/int4 linears (the same greedy token at every position of prompts longer than the windows),
and greedy speculation on it (drafts whose rows straddle a window's edge) is exactly plain
decoding under chunked prefill and preemption. Families with a switch it does not run yet (the
experts) say so in the kernels line and run the torch forward over the C GEMMs."""

from __future__ import annotations

import random

import pytest
import torch

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.entrypoints.llm import LLM
from tokenbudget.engine.loader.kv_shape import kv_elements_per_token
from tokenbudget.engine.loader.target import load_target_model
from tokenbudget.engine.model.cpu_forward import kernels_summary, unsupported_switches
from tokenbudget.kernels.cpu.native import library

from model_families import make_family_dir
from paged_forward import chunked_logits, make_runner, random_tables

pytestmark = pytest.mark.skipif(library() is None, reason="needs a C compiler for the C kernels")

# the family and its overrides: every dense family runs on the C forward, sliding windows of 8 keys
# (prompts of 32-40 tokens cross them), Gemma 2's soft-cap and GeGLU included
C_FORWARD = {
    "llama": {}, "qwen3": {}, "olmo2": {}, "granite": {}, "phi3": {}, "qwen2": {}, "smollm3": {},
    "mistral": {}, "ministral": {}, "gemma2": {}, "gemma3_text": {},
}
TORCH_FORWARD = {"gpt_oss": "experts", "mixtral": "experts"}
PROMPTS = [[(7 * i) % 250 for i in range(40)], [42] * 6 + list(range(100, 120)) + [42] * 6]


@pytest.fixture(scope="module", params=list(C_FORWARD))
def family_dir(request, tmp_path_factory):
    return request.param, make_family_dir(tmp_path_factory.mktemp(request.param), request.param,
                                          **C_FORWARD[request.param])


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_c_forward_is_the_torch_forward(family_dir, quantization) -> None:
    name, path = family_dir
    target = load_target_model(path, quantization=quantization)
    wrapped = target.model
    assert getattr(wrapped, "cpu_forward", None) is not None, (name, unsupported_switches(target.config))
    assert "decoder forward" in kernels_summary(wrapped)
    runner = make_runner(wrapped, target.config, num_blocks=40, block_size=4)
    rng = random.Random(0)
    tables = random_tables(rng, [len(p) for p in PROMPTS], 40, 4)
    c_path = chunked_logits(runner, PROMPTS, tables, random.Random(1))
    runner.model = wrapped.model  # the same quantized linears, torch's layer code
    torch_path = chunked_logits(runner, PROMPTS, tables, random.Random(1))
    # Both quantize each GEMM's input rows to int8 inside the same C GEMMs; the row ops before them
    # (norms, RoPE) differ in the last bits (16-lane sums vs torch's), which can flip an activation's
    # rounding: a few 1e-3 of the logits' scale. A switch done wrong is off by their whole scale.
    for got, want in zip(c_path, torch_path):
        assert ((got - want).abs().max() / want.abs().max()).item() < 3e-2, name
        assert torch.equal(got.argmax(-1), want.argmax(-1)), name  # greedy: the same token at every position


def test_speculation_on_the_c_forward_is_lossless(family_dir) -> None:
    name, path = family_dir
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(**kw):
        llm = LLM(path, quantization="int8", num_threads=1, **kw)
        assert "decoder forward" in kernels_summary(llm.engine.core.runner.model)
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm

    plain, _ = run(kv_cache_memory_bytes=4 << 20)
    pool = 12 * 8 * 2 * 4 * kv_elements_per_token(path) + 1  # 12 blocks of 8 for ~130 tokens in flight
    spec, llm = run(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, block_size=8,
                    max_num_batched_tokens=16, kv_cache_memory_bytes=pool)
    assert spec == plain, name
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", list(TORCH_FORWARD))
def test_a_switch_the_c_forward_lacks_is_named(family, tmp_path) -> None:
    target = load_target_model(make_family_dir(tmp_path / family, family), quantization="int8")
    assert getattr(target.model, "cpu_forward", None) is None
    assert TORCH_FORWARD[family] in kernels_summary(target.model)
