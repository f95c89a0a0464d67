"""Batch-invariant RMSNorm (Triton): one program per row, one fixed reduction per row.

Why (deterministic mode, ``EngineConfig(deterministic=True)``): torch's CUDA reduction behind
``x.pow(2).mean(-1)`` / ``torch.rms_norm`` picks its launch configuration (threads per row,
vectorisation, how a row is split between warps) from the tensor's shape, row count included,
so a row's sum of squares can be added up in a different order when it is decoded alone than
inside a (1 + k)-row verify. Here each row is one program that loads the whole row
(``BLOCK = next_power_of_2(hidden)``, masked) and reduces it with one ``tl.sum`` of that fixed
width: the order depends only on the hidden size, never on the other rows.

Numerics follow HF LlamaRMSNorm (``engine/model/layers.rms_norm``): normalise in fp32, cast to
the activation dtype, then multiply by the weight in that dtype. Checked against it and for row
invariance under ``TRITON_INTERPRET=1`` in CI (``tests/test_triton_rmsnorm.py``); on a GPU by the
``cuda``-marked test there.
"""

from __future__ import annotations

import functools

import torch

from tokenbudget.kernels.triton_utils import next_power_of_2


@functools.cache
def _kernel():
    """Build the kernel on first use (imports triton; honours TRITON_INTERPRET)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, sx, sy, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        normed = (x * (1.0 / tl.sqrt(var + eps))).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(y_ptr + row * sy + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)

    return _rms_norm_kernel


def rms_norm_batch_invariant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, H]`` -> ``[T, H]`` in ``x.dtype``; row ``i`` is the same bits for any ``T``."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm_batch_invariant: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.shape[0]:
        block = next_power_of_2(x.shape[1])
        _kernel()[(x.shape[0],)](x, weight.to(x.dtype).contiguous(), y, x.stride(0), y.stride(0),
                                 x.shape[1], eps, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return y


__all__ = ["rms_norm_batch_invariant"]
