"""Weight-only quantized linears (``quantization`` = int8 | int4, engine/model/quant.py).

Checked: the kernels approximate the float linear; quantizing drops every float linear weight;
bad values are ValueErrors naming the field; ``auto`` follows what the GGUF holds; and on the
default model, greedy n-gram speculation equals plain greedy decoding token for token in each
mode (batch invariance of the quantized paths, end to end; per-position bits are checked in
tests/test_batch_invariance.py).
"""

from __future__ import annotations

import pytest
import torch

from tokenbudget.api.config import EngineConfig
from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.entrypoints.llm import LLM
from tokenbudget.engine.model.layers import Linear
from tokenbudget.engine.model.quant import QuantLinear, quantize_model

from batch_schedules import CFG, random_state_dict
from engine_fixtures import ENGINE_OPTS, default_loaded


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("mode,tol", [("int8", 0.02), ("int4", 0.15)])
@pytest.mark.parametrize("n", [96, 101, 160])
def test_quant_linear_approximates_float(mode, tol, n, kernel, request):
    """Each kernel named, not ``auto``: a machine without the C kernels skips (naming what it
    lacks) rather than running torch's kernels under both names."""
    if kernel == "native":
        request.getfixturevalue("c_kernels")
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, 96, generator=g), torch.randn(7, 96, generator=g)
    b = torch.randn(n, generator=g)
    lin = QuantLinear.from_float(w, mode, b, kernel=kernel)
    assert lin.kernel == kernel
    got = lin(x)
    want = torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).norm() / want.norm() < tol


def test_quantize_model_keeps_no_float_linear():
    from tokenbudget.engine.model import build_model
    model = quantize_model(build_model(CFG, random_state_dict(CFG), torch.float32, "cpu"), "int4")
    linears = [model.lm_head] + [getattr(lw, f) for lw in model.layers for f in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(lin, QuantLinear) for lin in linears)
    assert not any(isinstance(v, Linear) for v in vars(model).values())


@pytest.mark.parametrize("kwargs,field", [({"quantization": "int3"}, "quantization"),
                                          ({"quantization": "int4", "dtype": "bfloat16"}, "quantization"),
                                          ({"quantization": "int8", "device": "cuda"}, "quantization")])
def test_bad_quantization_is_a_value_error(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_auto_follows_the_gguf():
    from tokenbudget.engine.loader.weight_quant import resolve_quantization
    src = default_loaded().source  # the Q4_1 default model
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", src, torch.float32, cpu) == "int4"
    assert resolve_quantization("auto", src, torch.bfloat16, cpu) == "none"
    assert resolve_quantization("int8", src, torch.float32, cpu) == "int8"


@pytest.fixture(scope="module", params=["int8", "int4"])
def quant_target(request):
    from tokenbudget.engine.loader import LoadedModel
    from tokenbudget.engine.loader.target import build_target
    base = default_loaded()
    copy = LoadedModel(base.config, dict(base.state_dict), base.tokenizer, base.source, base.weight_type)
    return build_target(copy, torch.float32, torch.device("cpu"), request.param)


PROMPTS = ["Rewrite this code with type hints:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
           "What is the capital of France?", "Summarize: the cat sat on the mat. The cat sat on the mat again."]


def test_greedy_ngram_equals_plain_per_mode(quant_target):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def gen(**opts):
        llm = LLM(quant_target, **(ENGINE_OPTS | opts))
        return llm, [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    _, plain = gen(quantization=quant_target.quantization)
    llm, spec = gen(max_num_batched_tokens=16,  # chunked prefill mixed with verifies
                    speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert spec == plain
    assert llm.get_spec_stats().num_accepted_tokens > 0  # the code prompt repeats its input
