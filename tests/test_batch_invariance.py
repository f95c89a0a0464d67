"""Batch invariance: a position's logits are the same BITS whatever shares its forward.

Findings on this CPU (AMD EPYC AVX-512, torch 2.13 CPU + MKL 2024.2, 1-2 threads), details in
``engine/model/llama.py`` and ``kernels/attention/torch_ref.py``:
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
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.quant import quantize_model
from tokenbudget.engine.worker.kv_cache_alloc import allocate_kv_caches
from tokenbudget.engine.worker.model_runner import ModelRunner
from tokenbudget.scheduler.output import SchedulerOutput
from tokenbudget.scheduler.request import Request

from model_helpers import scheduled

CFG = ModelConfig(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d = cfg.hidden_size, cfg.resolved_head_dim
    q, kv, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size

    def w(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": w(cfg.vocab_size, h, scale=1.0),
          "model.norm.weight": 1 + w(h, scale=0.1)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        sd |= {p + "input_layernorm.weight": 1 + w(h, scale=0.1),
               p + "post_attention_layernorm.weight": 1 + w(h, scale=0.1),
               p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
               p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
               p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
               p + "mlp.down_proj.weight": w(h, i)}
    return sd



def run_schedule(model, seqs, chunker, dtype, seed):
    """Run all sequences to completion, chunk sizes from ``chunker(rng, remaining)``; requests are
    batched together in each step (random subsets). Returns per-sequence logits [len, V]."""
    rng = random.Random(seed)
    block_size, num_blocks = 8, 160
    runner = ModelRunner(model, CFG, allocate_kv_caches(CFG, num_blocks, block_size, dtype, "cpu"),
                         block_size, sampler=None)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for s in seqs:
        nb = -(-len(s) // block_size)
        tables.append(ids[at:at + nb])
        at += nb
    reqs = [Request(f"s{i}", s) for i, s in enumerate(seqs)]
    done = [0] * len(seqs)
    out = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        chosen = [i for i in live if rng.random() < 0.7] or live[:1]
        rng.shuffle(chosen)
        sched = SchedulerOutput()
        for i in chosen:
            n = chunker(rng, len(seqs[i]) - done[i])
            sched.scheduled.append(scheduled(reqs[i], done[i], n, seqs[i][done[i]:done[i] + n], [], tables[i]))
            done[i] += n
        x, pos, md, _ = runner.prepare_inputs(sched)
        logits = model.compute_logits(model(x, pos, md, runner.kv_caches))
        for b, i in enumerate(chosen):
            out[i].append(logits[md.qo_indptr[b]:md.qo_indptr[b + 1]])
    return [torch.cat(o) for o in out]


SCHEDULES = {
    "whole": lambda rng, rem: rem,
    "decode": lambda rng, rem: 1,
    "verify_like": lambda rng, rem: min(rem, rng.choice([1, 2, 3, 4, 5, 6])),
    "random_chunks": lambda rng, rem: min(rem, rng.randint(1, 70)),
}


@pytest.fixture(params=["c", "torch"])
def quant_kernel(request, monkeypatch):
    """``c``: the C kernels and forward (kernels/cpu; conftest's ``c_kernels`` skips naming the
    missing CPU flag or compiler, so a machine without them never runs the torch case twice);
    ``torch``: torch's weight-only kernels and the torch forward, as on a machine without AVX-512 VNNI."""
    if request.param == "c":
        request.getfixturevalue("c_kernels")
        from tokenbudget.kernels.cpu import quant_gemm
        assert quant_gemm.supports(CFG.hidden_size) and quant_gemm.supports(CFG.intermediate_size)
    else:
        monkeypatch.setattr("tokenbudget.kernels.cpu.quant_gemm.supports", lambda in_features: False)
    return request.param


def _assert_runs_on(model, quantization: str, quant_kernel: str) -> None:
    """The quantized model takes the path the case names (the one-call C forward iff ``c``)."""
    if quantization != "none":
        assert (model.cpu_forward is not None) == (quant_kernel == "c"), (quantization, quant_kernel)


# An unquantized model involves no quantized kernel: its cases run once (``torch``), not twice.
KERNEL_CASES = [(torch.float32, "none", "torch"), (torch.bfloat16, "none", "torch")] + [
    (torch.float32, q, k) for q in ("int8", "int4") for k in ("c", "torch")]


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
