"""The C GEMMs against a reference that shares none of their code (issue 43: the GEMM tests built
their reference activations with the kernel's own quantizer, so a broken group max passed them).

Everything the reference uses is written here from the documented rules:
* activations: per row and group of 32, ``d = amax / 127`` (fp32), ``q = round_half_even(x *
  (127 / amax))``, as GGUF's Q8 activations (quant_gemm.c's header); groups whose largest
  magnitude comes last (negative, so that a max without ``abs`` is wrong too), first, or is the
  only non-zero, and an all-zero group;
* q4 weights: codes q in [0, 15], fp16 d and m per group of 32, ``w = q d + m`` (GGUF Q4_1), the
  codes drawn here and handed to the packer, the reference computed from the codes, not from the
  packed form's ``dequantize``; and GGUF's byte layout for Q4_1 and Q8_0 written here (fp16 d
  (and m), then byte i = element i in the low nibble, element i + 16 in the high one for Q4_1;
  int8 elements for Q8_0) and read by the loader's dequantizer and the ``gguf`` package's;
* q8 weights: codes in [-127, 127] and an fp32 scale per output channel, ``w = q s``.
The product is then float64 ``x_hat @ w^T``; the kernels' float rule rounds each group's sum once
more than float64 does, so the bound is relative (1e-5 of the largest output)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenbudget.engine.loader.gguf_dequant import dequantize_blocks_torch
from tokenbudget.kernels.cpu import quant_gemm as cg

GROUP = 32


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    groups = x.view(m, k // GROUP, GROUP)
    groups[0, :, -1] = -25.0  # the largest magnitude last, negative
    groups[1, :, 0] = 30.0    # first
    groups[2, 0] = 0.0        # an all-zero group
    groups[2, 0, -1] = 7.0    # ... but one element: the only non-zero, last
    groups[3] = 0.0           # an all-zero row
    return x


def _quantize_activations_reference(x: torch.Tensor) -> torch.Tensor:
    """x_hat (float64): the values the kernel multiplies by, from the documented rule."""
    m, k = x.shape
    g = x.float().view(m, k // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv)  # torch.round: half to even
    assert q.abs().max() <= 127
    return (q.double() * d.double()).view(m, k)


def _q4_codes(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // GROUP, generator=g) * 0.01 + 1e-3).half().float()
    mn = (-torch.rand(n, k // GROUP, generator=g) * 0.08).half().float()
    w = q.double().view(n, k // GROUP, GROUP) * d.double()[..., None] + mn.double()[..., None]
    return q, d, mn, w.view(n, k)


@pytest.mark.parametrize("n,k", [(48, 64), (37, 256), (16, 32)])
def test_q4_gemm_equals_the_documented_arithmetic(variant, n, k):
    x = _activations(9, k, seed=n * k)
    q, d, mn, w = _q4_codes(n, k, seed=n * k)
    y = cg.gemm_q4(x, cg.Q4Weight.from_codes(q, d, mn)).double()
    want = _quantize_activations_reference(x) @ w.T
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(y[3], torch.zeros(n, dtype=torch.float64))


@pytest.mark.parametrize("n,k", [(48, 64), (37, 256)])
def test_q8_gemm_equals_the_documented_arithmetic(variant, n, k):
    x = _activations(9, k, seed=n + k)
    g = torch.Generator().manual_seed(n - k)
    q = torch.randint(-127, 128, (n, k), generator=g)
    s = torch.rand(n, generator=g) * 0.01 + 1e-4
    y = cg.gemm_q8(x, cg.Q8Weight.from_codes(q, s)).double()
    want = _quantize_activations_reference(x) @ (q.double() * s.double()[:, None]).T
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()


def test_gguf_q4_1_and_q8_0_blocks_read_as_their_documented_layout():
    """Blocks written here byte by byte; the loader's dequantizer and the ``gguf`` package's agree
    with the codes they were written from."""
    n, k = 8, 64
    q, d, mn, w = _q4_codes(n, k, seed=5)
    blocks = []
    for r in range(n):
        for b in range(k // GROUP):
            codes = q[r, b * GROUP:(b + 1) * GROUP].numpy().astype(np.uint8)
            qs = codes[:16] | (codes[16:] << 4)
            blocks.append(np.concatenate([np.array([d[r, b], mn[r, b]], np.float16).view(np.uint8), qs]))
    raw = np.stack(blocks)  # [n * k / 32, 20]: GGUF Q4_1
    ours = dequantize_blocks_torch(raw, gguf.GGMLQuantizationType.Q4_1).double().reshape(n, k)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.Q4_1)).double()
    assert torch.equal(ours, w) and torch.equal(theirs.reshape(n, k), w)

    g = torch.Generator().manual_seed(6)
    q8 = torch.randint(-127, 128, (n, k), generator=g)
    d8 = (torch.rand(n, k // GROUP, generator=g) * 0.01 + 1e-3).half().float()
    raw8 = np.stack([np.concatenate([np.array([d8[r, b]], np.float16).view(np.uint8),
                                     q8[r, b * GROUP:(b + 1) * GROUP].numpy().astype(np.int8).view(np.uint8)])
                     for r in range(n) for b in range(k // GROUP)])  # [n * k / 32, 34]: GGUF Q8_0
    want8 = (q8.double().view(n, k // GROUP, GROUP) * d8.double()[..., None]).view(n, k)
    ours8 = dequantize_blocks_torch(raw8, gguf.GGMLQuantizationType.Q8_0).double().reshape(n, k)
    theirs8 = torch.from_numpy(gguf.quants.dequantize(raw8.reshape(-1), gguf.GGMLQuantizationType.Q8_0)).double()
    assert torch.equal(ours8, want8) and torch.equal(theirs8.reshape(n, k), want8)
