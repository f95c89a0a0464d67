"""The batch-invariant Triton matmul == torch.matmul, and a row's bits do not depend on M.

Without CUDA the kernel runs under Triton's interpreter in a child process (see
``triton_interp``); skipped when triton is not installed.
"""

from __future__ import annotations

import pytest
import torch

from triton_interp import needs_cuda, needs_triton, run_interpreted  # noqa: E402


def _check_matmul(device: str) -> None:
    from tokenbudget.kernels.batch_invariant_matmul import matmul_batch_invariant

    g = torch.Generator().manual_seed(0)
    cases = [(96, 80, torch.float32), (130, 64, torch.float32), (64, 200, torch.float16)]
    if device == "cuda":  # the triton 3.6 interpreter's tl.dot misreads bf16 (numpy has no bf16)
        cases.append((64, 200, torch.bfloat16))
    for k, n, dtype in cases:
        w = torch.randn(n, k, generator=g).to(device, dtype)
        x = torch.randn(37, k, generator=g).to(device, dtype)
        full = matmul_batch_invariant(x, w, out_dtype=torch.float32)
        want = torch.matmul(x.float(), w.float().t())
        torch.testing.assert_close(full, want, atol=1e-3 if dtype == torch.float32 else 3e-2, rtol=1e-3)
        for m in (1, 2, 3, 5, 16, 17):   # the same rows alone or in smaller batches: same bits
            assert torch.equal(matmul_batch_invariant(x[:m], w, out_dtype=torch.float32), full[:m]), (k, n, m)
        assert torch.equal(matmul_batch_invariant(x[20:21], w, out_dtype=torch.float32), full[20:21])
        assert matmul_batch_invariant(x, w).dtype == dtype


@needs_triton
def test_batch_invariant_matmul_interpreted():
    run_interpreted(__file__, globals(), "_check_matmul", "cpu")


@pytest.mark.cuda
@needs_triton
@needs_cuda
def test_batch_invariant_matmul_cuda():
    _check_matmul("cuda")


def _check_deterministic_model() -> None:
    """Deterministic mode switches every linear of the real model to the invariant matmul:
    same logits as the default path (to rounding), and a row's logits alone == inside 7 rows."""
    from tokenbudget.engine.model import build_model
    from tokenbudget.engine.model.config import ModelConfig
    from tokenbudget.engine.worker.deterministic import apply_deterministic_mode

    from batch_schedules import random_state_dict

    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    sd = random_state_dict(cfg, seed=1)
    plain, det = build_model(cfg, sd), build_model(cfg, sd)
    assert apply_deterministic_mode(det, "cpu")
    assert all(lin.invariant for lin in (det.layers[0].qkv, det.layers[0].down, det.lm_head))
    from tokenbudget.kernels.rmsnorm_triton import rms_norm_batch_invariant
    assert det.rms_norm is rms_norm_batch_invariant and plain.rms_norm is not rms_norm_batch_invariant
    hidden = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    got = det.compute_logits(hidden)
    torch.testing.assert_close(got, plain.compute_logits(hidden), atol=1e-4, rtol=1e-4)
    # the same row at the same offset of its 16-row tile, in batches of 1..7 rows: the kernel's
    # shape never depends on M. (Moving a row to another offset of the tile is not checked here:
    # the interpreter's tl.dot is numpy's OpenBLAS sgemm, whose rows 6..15 of a 16-row GEMM are
    # added up differently from rows 0..5 on this CPU; on a GPU, _check_matmul's row 20 alone
    # checks an offset change.)
    assert torch.equal(det.compute_logits(hidden[:1]), got[:1])
    for i in (3, 6):
        assert torch.equal(det.compute_logits(hidden[:i + 1])[i], got[i])


@needs_triton
def test_deterministic_mode_model_interpreted():
    run_interpreted(__file__, globals(), "_check_deterministic_model")


def test_deterministic_mode_is_a_noop_on_cpu_without_the_interpreter(monkeypatch):
    from tokenbudget.api.config import EngineConfig
    from tokenbudget.engine.worker.deterministic import apply_deterministic_mode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert apply_deterministic_mode(object(), "cpu") is False
    assert EngineConfig(deterministic=True).deterministic
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic="yes")


def test_deterministic_mode_leaves_process_wide_cublas_flags_alone(monkeypatch):
    """Every GEMM of the target goes through the Triton matmul in deterministic mode, so the
    process-wide cuBLAS flags it used to flip (and never restore) changed nothing of its own."""
    from tokenbudget.engine.model import build_model
    from tokenbudget.engine.model.config import ModelConfig
    from tokenbudget.engine.worker import deterministic

    from batch_schedules import random_state_dict

    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = build_model(cfg, random_state_dict(cfg, seed=1))
    monkeypatch.setattr(deterministic, "triton_runnable_on", lambda device: True)
    flags = torch.backends.cuda.matmul
    # saved and restored by hand: these are properties served by the cuBLAS module's __getattr__,
    # which pytest >= 9.2's monkeypatch takes for missing attributes (and deletes at teardown)
    saved = flags.allow_tf32, flags.allow_bf16_reduced_precision_reduction
    try:
        flags.allow_tf32 = flags.allow_bf16_reduced_precision_reduction = True
        assert deterministic.apply_deterministic_mode(model, "cuda")
        assert flags.allow_tf32 and flags.allow_bf16_reduced_precision_reduction
    finally:
        flags.allow_tf32, flags.allow_bf16_reduced_precision_reduction = saved
    assert model.lm_head.invariant
