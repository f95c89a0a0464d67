"""Batch invariance: a position's logits are the same BITS whatever shares its forward.

Findings on this CPU (AMD EPYC AVX-512, torch 2.13 CPU + MKL 2024.2, 1-2 threads), details in
``engine/model/decoder.py`` and ``kernels/attention/torch_ref.py``:
* fp32 F.linear has row paths M=1 | M in {2,3} | M>=4 (+ a 2-thread remainder split for
  M in {5..7, 9..11}); padding every GEMM's rows to a multiple of 4 makes rows bitwise invariant.
* bf16 F.linear: M=1 differs from M>=2 for some shapes; same padding covers it.
* SDPA is not invariant; the reference backend uses padded bmm + fixed 256-key P@V tiles.
* the weight-only quantized kernels (int8 per-channel, int4 groupwise; engine/model/quant.py)
  are row-invariant at any row count: torch's (benches/quant_kernels.py) and ours, with the
  one-call C forward (kernels/cpu); both checked here end to end.
Cost, SmolLM2-135M-shaped fp32 random model, batch-1 decode: see the report (runner benchmark).

Here: every position of several sequences gets bitwise identical logits under different
schedules: whole-prompt prefill, random chunking with other requests in the batch, 1-token
decodes, and (1 + k)-token verify-shaped chunks next to a prefill and a decode.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.cpu_forward import CpuForwardModel
from tokenbudget.engine.model.quant import quantize_model

from batch_schedules import CFG, SCHEDULES, random_state_dict, run_schedule
from native_variants import VARIANTS, use_variant


@pytest.fixture
def quant_kernel(request, monkeypatch):
    """A C kernel variant (kernels/cpu; each one this CPU executes, tests/native_variants.py) with
    the C forward, or ``torch``: torch's weight-only kernels and the torch forward, as where no C
    variant runs."""
    if request.param == "torch":
        monkeypatch.setattr("tokenbudget.kernels.cpu.quant_gemm.supports", lambda in_features: False)
    else:
        use_variant(request.param, monkeypatch)
    return request.param


def _assert_runs_on(model, quantization: str, quant_kernel: str) -> None:
    """The quantized model takes the path the case names (the one-call C forward iff a C variant)."""
    if quantization != "none":
        assert isinstance(model, CpuForwardModel) == (quant_kernel != "torch"), (quantization, quant_kernel)


# An unquantized model involves no quantized kernel: its cases run once (``torch``).
KERNEL_CASES = [(torch.float32, "none", "torch"), (torch.bfloat16, "none", "torch")] + [
    (torch.float32, q, k) for q in ("int8", "int4") for k in (*VARIANTS, "torch")]


@pytest.mark.parametrize("dtype,quantization,quant_kernel", KERNEL_CASES, indirect=["quant_kernel"])
def test_logits_bitwise_identical_across_schedules(dtype, quantization, quant_kernel):
    model = quantize_model(build_model(CFG, random_state_dict(CFG), dtype, "cpu"), quantization)
    _assert_runs_on(model, quantization, quant_kernel)
    rng = random.Random(1)
    seqs = [[rng.randrange(CFG.vocab_size) for _ in range(n)] for n in (3, 37, 70, 290)]
    results = {name: run_schedule(model, seqs, fn, dtype, seed)
               for seed, (name, fn) in enumerate(SCHEDULES.items())}
    ref = results.pop("whole")
    for name, got in results.items():
        for s, (a, b) in enumerate(zip(ref, got)):
            diff = (a != b).any(-1).nonzero().flatten().tolist()
            assert not diff, f"{dtype}/{quantization} schedule {name!r}, seq {s}: positions {diff[:10]} differ"


@pytest.mark.parametrize("quantization,quant_kernel", [(q, k) for _, q, k in KERNEL_CASES[1:]],
                         indirect=["quant_kernel"])
def test_position_alone_vs_in_batch(quantization, quant_kernel):
    """One position computed by a 1-token forward equals the same position inside a 5-row verify
    chunk batched with a prefill chunk and a decode of other requests."""
    model = quantize_model(build_model(CFG, random_state_dict(CFG, seed=3), torch.float32, "cpu"),
                           quantization)
    _assert_runs_on(model, quantization, quant_kernel)
    rng = random.Random(5)
    seqs = [[rng.randrange(CFG.vocab_size) for _ in range(n)] for n in (20, 33, 9)]
    alone = run_schedule(model, [seqs[0]], lambda r, rem: 15 if rem == 20 else 1, torch.float32, 0)
    mixed = run_schedule(model, seqs, lambda r, rem: 5 if rem == 5 else min(rem, 15), torch.float32, 1)
    assert torch.equal(alone[0][15:], mixed[0][15:])
