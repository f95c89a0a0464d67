"""Batch-invariant matmul (Triton): ``y[M, N] = x[M, K] @ w[N, K].T`` with ONE tiling for every M.

Why (deterministic mode, ``EngineConfig(deterministic=True)``): cuBLAS picks its kernel, tile and
split-K from the problem shape, so a row's bits depend on how many rows share the GEMM (a decode
row alone, M = 1, vs the same row inside a (1 + k)-row verify). Here every output element is one
program's fp32 accumulation over K in fixed ``BLOCK_K`` steps, in order, with the same
``BLOCK_M x BLOCK_N x BLOCK_K`` tile whatever M is: no split-K, no shape-dependent choice. So row
``i`` of the result is the same bits for any M and any other rows.

Cost: slower than cuBLAS (no autotuning, no split-K, small fixed tiles); on an H200 with an 8B
shape a decode step costs about what eager cuBLAS costs, a verify step more (benches/RESULTS.md,
"First GPU run"). Checked against ``torch.matmul`` under the Triton interpreter
(``TRITON_INTERPRET=1``) in CI: ``tests/test_batch_invariant_matmul.py``.
"""

from __future__ import annotations

import functools

import torch

from tokenbudget.kernels.triton_utils import triton_runnable_on

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@functools.cache
def _kernel():
    """Build the kernel on first use (imports triton; honours TRITON_INTERPRET)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, sxm, sxk, swn, swk, sym, syn,
                       K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1).to(tl.int64)
        rm = pid_m * BM + tl.arange(0, BM).to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN).to(tl.int64)
        rk = tl.arange(0, BK).to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc += tl.dot(x, w, input_precision="ieee", out_dtype=tl.float32)  # fp32: no tf32
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn,
                 acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return _matmul_kernel


def matmul_batch_invariant(x: torch.Tensor, weight: torch.Tensor,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x[M, K] @ weight[N, K].T`` -> ``[M, N]`` (``out_dtype`` default ``x.dtype``)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"shapes {tuple(x.shape)} @ {tuple(weight.shape)}.T do not match")
    if not triton_runnable_on(x.device):
        raise RuntimeError(f"Triton cannot run on {x.device} (need CUDA, or TRITON_INTERPRET=1)")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
    _kernel()[grid](x, weight, y, m, n, *x.stride(), *weight.stride(), *y.stride(),
                    K=k, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return y


__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "matmul_batch_invariant"]
