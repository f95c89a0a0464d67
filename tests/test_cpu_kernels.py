"""The C kernels of ``kernels/cpu`` (weight-only GEMMs, the one-call decoder forward), every variant.

Checked against torch references built from what the kernels multiply (``dequantize`` of the
weight, the kernels' own activation quantization): the GEMMs to fp32 rounding, every output row
bitwise equal alone and inside any row count, at 1 and 2 threads; the C forward against the torch
forward of the same quantized model, and bitwise invariant across schedules (prefill whole, in
chunks next to other requests, one token at a time). Each test runs once per kernel variant this
CPU can execute (``variant``, tests/native_variants.py: AVX-512 VNNI, AVX-VNNI, AVX2, NEON, and
``scalar`` everywhere); the others skip naming the missing instructions. The NEON variant runs on
x86 under qemu (tests/test_neon_qemu.py). The variants compute the same IEEE operations
(quant_gemm.c's float rule): their outputs are compared bitwise with ``scalar``'s.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.quant import QuantLinear, quantize_model
from tokenbudget.kernels.cpu import quant_gemm as cg

import batch_schedules as tbi
from native_variants import q4_weight, q8_weight, use_variant

# Every linear's in_features a multiple of 32 and head_dim of 16: the C forward takes the model.
CFG64 = ModelConfig(vocab_size=101, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
# By head size: the AVX-512 attention is compiled apart for D = 64 and D = 128 (and once for any
# other D, here 32), so the bitwise and invariance tests run all three.
CFG_BY_HEAD_DIM = {
    32: CFG64,
    64: ModelConfig(vocab_size=101, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    rms_norm_eps=1e-5, tie_word_embeddings=True),
    128: ModelConfig(vocab_size=101, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                     rms_norm_eps=1e-5, tie_word_embeddings=True),
    # Gemma 2's attention switches at D = 64: a sliding layer of 24 keys (contexts up to 290 cross it,
    # verifies and chunks straddle it) beside a full one, the logit soft-cap, and GeGLU
    "64 (window, soft-cap, GeGLU)": ModelConfig(
        vocab_size=101, hidden_size=256, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True,
        sliding_window=24, layer_types=("sliding_attention", "full_attention"), attn_logit_softcapping=2.0,
        hidden_act="gelu_pytorch_tanh"),
}



@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("n,k", [(96, 64), (960, 576), (576, 1536), (37, 96), (5, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_matches_reference_and_rows_are_invariant(variant, fmt, n, k, threads):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.05
    weight, gemm = (q4_weight(w), cg.gemm_q4) if fmt == "q4" else (q8_weight(w), cg.gemm_q8)
    x = torch.randn(13, k, generator=g)  # 13 rows: a tile of 8 and one of 5
    x[3, 5] = 40.0  # an outlier only moves its own group's scale
    x[7] = 0.0      # an all-zero row (scale 0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = gemm(x, weight)
        rows = [torch.cat([gemm(x[i:i + 1], weight) for i in range(13)])]
        rows += [torch.cat([gemm(x[a:a + m], weight) for a in range(0, 13, m)]) for m in (2, 3, 4, 5, 8, 9)]
    finally:
        torch.set_num_threads(old)
    xq, xd = cg.quantize_activations(x)
    x_hat = (xq.double().reshape(13, -1, 32) * xd.double()[..., None]).reshape(13, k)
    want = x_hat @ weight.dequantize().double().T
    assert (y.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(y[7], torch.zeros(n))
    for r in rows:
        assert torch.equal(r, y)


@pytest.mark.parametrize("m,k", [(150, 64), (700, 1536)])   # 3 row blocks columns outer; rows outer
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_rows_across_row_blocks_equal_rows_alone(variant, m, k, threads):
    """Past 64 rows the work items span several row blocks, split columns outer up to 1 MB of
    quantized rows and rows outer beyond (quant_gemm.c): either order, every row is bitwise what
    a 13-row call computes for it."""
    g = torch.Generator().manual_seed(m)
    weight = q4_weight(torch.randn(48, k, generator=g) * 0.05)
    x = torch.randn(m, k, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = cg.gemm_q4(x, weight)
        alone = torch.cat([cg.gemm_q4(x[a:a + 13], weight) for a in range(0, m, 13)])
    finally:
        torch.set_num_threads(old)
    assert torch.equal(y, alone)


def test_activation_quantization_is_q8_per_group_of_32(variant):
    x = torch.randn(3, 128)
    q, d = cg.quantize_activations(x)
    amax = x.reshape(3, 4, 32).abs().amax(-1)
    assert torch.equal(d, amax / 127)
    want = torch.round(x.reshape(3, 4, 32) * (127 / amax)[..., None]).reshape(3, 128)
    assert torch.equal(q.float(), want)


def test_q4_weight_keeps_gguf_q4_1_codes(variant):
    w = torch.randn(64, 128) * 0.1
    weight = q4_weight(w)
    assert weight.packed.shape == (4, 4, 320) and weight.nbytes() == 64 * 128 * 5 // 8  # GGUF Q4_1's 5 bits
    assert (weight.dequantize() - w).abs().max() <= weight.scales_and_mins()[0].max() * 0.51


def test_quant_linear_picks_the_c_kernels_where_they_run(variant):
    w = torch.randn(96, 128)
    assert QuantLinear.from_float(w, "int4").kernel == "native"
    assert QuantLinear.from_float(w, "int4", kernel="torch").kernel == "torch"
    assert QuantLinear.from_float(torch.randn(96, 80), "int8").kernel == "torch"  # K not a multiple of 32
    with pytest.raises(ValueError, match="native"):
        QuantLinear.from_float(torch.randn(96, 80), "int8", kernel="native")


def _model(mode: str, seed: int = 0, cfg: ModelConfig = CFG64):
    return quantize_model(build_model(cfg, tbi.random_state_dict(cfg, seed), torch.float32, "cpu"), mode)


@pytest.fixture
def cfg64(monkeypatch):
    monkeypatch.setattr(tbi, "CFG", CFG64)


@pytest.fixture(params=list(CFG_BY_HEAD_DIM), ids=lambda d: f"head_dim{d}")
def cfg_d(request, monkeypatch):
    """Each head size's config, installed as the schedules' model config."""
    cfg = CFG_BY_HEAD_DIM[request.param]
    monkeypatch.setattr(tbi, "CFG", cfg)
    return cfg


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_c_forward_matches_the_torch_forward(variant, cfg64, mode):
    model = _model(mode)
    assert model.cpu_forward is not None
    rng = random.Random(1)
    seqs = [[rng.randrange(CFG64.vocab_size) for _ in range(n)] for n in (3, 37, 70, 290)]
    native = tbi.run_schedule(model, seqs, tbi.SCHEDULES["whole"], torch.float32, 0)
    model.cpu_forward = None
    torch_path = tbi.run_schedule(model, seqs, tbi.SCHEDULES["whole"], torch.float32, 0)
    for a, b in zip(native, torch_path):
        # the same GEMMs; attention and norms round differently, and a last-bit difference can flip an
        # activation's int8 rounding in the next layer
        assert (a - b).abs().max() <= 1e-2 * b.abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_c_forward_is_batch_invariant(variant, cfg_d, mode):
    model = _model(mode, seed=2, cfg=cfg_d)
    rng = random.Random(3)
    seqs = [[rng.randrange(cfg_d.vocab_size) for _ in range(n)] for n in (3, 37, 70, 290)]
    ref = tbi.run_schedule(model, seqs, tbi.SCHEDULES["whole"], torch.float32, 0)
    for seed, name in enumerate(("decode", "verify_like", "random_chunks"), 1):
        got = tbi.run_schedule(model, seqs, tbi.SCHEDULES[name], torch.float32, seed)
        for s, (a, b) in enumerate(zip(ref, got)):
            diff = (a != b).any(-1).nonzero().flatten().tolist()
            assert not diff, f"{mode} schedule {name!r}, seq {s}: positions {diff[:10]} differ"


def test_c_forward_refuses_out_of_range_indices(variant, cfg64):
    """The C forward indexes raw memory: bad positions or slots raise IndexError (as torch's
    indexing does on the torch path) and leave the cache untouched."""
    from tokenbudget.engine.worker.kv_cache_alloc import allocate_kv_caches
    from tokenbudget.engine.worker.model_runner import ModelRunner
    from tokenbudget.scheduler.output import SchedulerOutput
    from tokenbudget.scheduler.request import Request

    from model_helpers import scheduled

    model = _model("int4")
    runner = ModelRunner(model, CFG64, allocate_kv_caches(CFG64, 4, 8, torch.float32, "cpu"), 8, sampler=None)
    sched = SchedulerOutput()
    sched.scheduled.append(scheduled(Request("r", [1, 2, 3]), 0, 3, [1, 2, 3], [], [2]))
    ids, pos, md, _ = runner.prepare_inputs(sched)
    for kv in runner.kv_caches:
        kv.zero_()  # the pool is torch.empty: compare against known contents, not NaN garbage
    before = [kv.clone() for kv in runner.kv_caches]
    bad_pos = pos.clone()
    bad_pos[1] = CFG64.max_position_embeddings
    with pytest.raises(IndexError, match="positions"):
        model(ids, bad_pos, md, runner.kv_caches)
    md.slot_mapping[2] = 4 * 8
    with pytest.raises(IndexError, match="slots"):
        model(ids, pos, md, runner.kv_caches)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))


def test_variant_gemms_equal_the_scalar_ones_bitwise(variant, monkeypatch):
    """Every variant follows quant_gemm.c's one float rule (no FMA, exact integer dot products), so
    its GEMMs give the scalar fallback's bits: a kernel that drifts from the rule shows here."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 320, generator=g) * 0.05
    x = torch.randn(11, 320, generator=g)
    got = [cg.gemm_q4(x, q4_weight(w)), cg.gemm_q8(x, q8_weight(w))]
    use_variant("scalar", monkeypatch)
    want = [cg.gemm_q4(x, q4_weight(w)), cg.gemm_q8(x, q8_weight(w))]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_variant_c_forward_equals_the_scalar_one_bitwise(variant, cfg_d, mode, monkeypatch):
    model = _model(mode, seed=5, cfg=cfg_d)
    rng = random.Random(6)
    seqs = [[rng.randrange(cfg_d.vocab_size) for _ in range(n)] for n in (5, 40, 131)]  # 131: key tails, blocks
    got = tbi.run_schedule(model, seqs, tbi.SCHEDULES["verify_like"], torch.float32, 7)
    use_variant("scalar", monkeypatch)
    want = tbi.run_schedule(model, seqs, tbi.SCHEDULES["verify_like"], torch.float32, 7)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
