"""Batch-invariant RMSNorm (``kernels/rmsnorm_triton.py``): HF LlamaRMSNorm numerics and a row's
bits independent of the row count, under the Triton interpreter (CI) and on a GPU (``cuda``)."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.engine.model.layers import rms_norm

from triton_interp import needs_cuda, needs_triton, run_interpreted  # noqa: E402


def _check_rms_norm(device: str) -> None:
    from tokenbudget.kernels.rmsnorm_triton import rms_norm_batch_invariant

    g = torch.Generator().manual_seed(0)
    for dtype, hidden in ((torch.float32, 96), (torch.float16, 576), (torch.float32, 4096)):
        x = (torch.randn(9, hidden, generator=g) * 3).to(device, dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
        got = rms_norm_batch_invariant(x, w, 1e-5)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, rms_norm(x, w, 1e-5), atol=tol, rtol=tol)
        for i in (0, 4, 8):
            assert torch.equal(rms_norm_batch_invariant(x[i:i + 1], w, 1e-5), got[i:i + 1])
            assert torch.equal(rms_norm_batch_invariant(x[i:i + 5], w, 1e-5)[0], got[i])
    with pytest.raises(ValueError, match="weight"):
        rms_norm_batch_invariant(x, w[:-1], 1e-5)


@needs_triton
def test_rms_norm_interpreted():
    run_interpreted(__file__, globals(), "_check_rms_norm", "cpu")


@pytest.mark.cuda
@needs_cuda
@needs_triton
def test_rms_norm_cuda():
    _check_rms_norm("cuda")
