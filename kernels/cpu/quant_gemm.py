"""torch-facing side of ``quant_gemm.c``: weight packing and the two GEMM calls.

Formats (the C file's header has the details): ``Q4Weight`` is GGUF Q4_1's arithmetic
(``w = q * d + m`` per group of 32 input columns, q in [0, 15], fp16 d and m), ``Q8Weight``
symmetric int8 per output channel (stored offset by +128); both laid out by blocks of 16 output
columns, so that one register lane holds 4 inputs of one column. Activations are quantized per
row and group of 32 inside the call. ``dequantize`` of either gives the weights the kernel
multiplies by, for references in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbudget.kernels.cpu.native import library

GROUP = 32
BLOCK = 16  # output columns per block (the lanes of a register)


def supports(in_features: int) -> bool:
    """Whether the C kernels can run a linear with this K (and are available at all)."""
    return in_features % GROUP == 0 and library() is not None


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` -> ``[N / 16, 16, ...]``, N padded with zeros to a multiple of 16."""
    t = torch.nn.functional.pad(t, [0, 0] * (t.dim() - 1) + [0, -t.shape[0] % BLOCK])
    return t.reshape(-1, BLOCK, *t.shape[1:])


@dataclass(slots=True, frozen=True)
class Q4Weight:
    """``packed`` uint8 ``[N / 16, K / 32, 320]``: per block of 16 output columns and group of 32
    inputs, 4 x 64 bytes of nibbles (sub-block s, lane j, byte i: low nibble = element 8s + i of
    column j, high = element 8s + 4 + i), then fp16 ``d[16]`` and ``m[16]``."""

    packed: torch.Tensor
    out_features: int

    @classmethod
    def from_codes(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4Weight:
        """``q`` int [N, K] in [0, 15]; ``d``, ``m`` [N, K / 32] (stored as fp16, GGUF Q4_1's)."""
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"in_features must be a multiple of {GROUP}, got {k}")
        c = _blocks(q.to(torch.uint8)).reshape(-1, BLOCK, k // GROUP, 4, 2, 4)  # [B, lane, g, sb, half, i]
        nib = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)      # [B, g, sb, lane, i]
        nb, ng = nib.shape[0], k // GROUP
        dm = torch.stack([_blocks(d), _blocks(m)], 2).to(torch.float16)       # [B, lane, 2, g]
        dm = dm.permute(0, 3, 2, 1).contiguous().view(torch.uint8).reshape(nb, ng, 64)
        return cls(torch.cat([nib.reshape(nb, ng, 256), dm], -1).contiguous(), n)

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * GROUP

    def codes(self) -> torch.Tensor:
        nb, ng = self.packed.shape[:2]
        nib = self.packed[:, :, :256].reshape(nb, ng, 4, BLOCK, 4)            # [B, g, sb, lane, i]
        c = torch.stack([nib & 0x0F, nib >> 4], 3)                          # [B, g, sb, half, lane, i]
        c = c.permute(0, 4, 1, 2, 3, 5).reshape(nb * BLOCK, ng * GROUP)
        return c[:self.out_features]

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        nb, ng = self.packed.shape[:2]
        dm = self.packed[:, :, 256:].contiguous().view(torch.float16).float().reshape(nb, ng, 2, BLOCK)
        dm = dm.permute(2, 0, 3, 1).reshape(2, nb * BLOCK, ng)[:, :self.out_features]
        return dm[0], dm[1]

    def dequantize(self) -> torch.Tensor:
        d, m = self.scales_and_mins()
        q = self.codes().float().reshape(self.out_features, -1, GROUP)
        return (q * d[..., None] + m[..., None]).reshape(self.out_features, -1)

    def nbytes(self) -> int:
        return self.packed.numel()


@dataclass(slots=True, frozen=True)
class Q8Weight:
    """``packed`` uint8 ``[N / 16, K / 32, 512]`` (sub-block s, lane j, byte i = element 4s + i of
    column j, stored as q + 128); ``s`` fp32 scales [N padded to 16]."""

    packed: torch.Tensor
    s: torch.Tensor
    out_features: int

    @classmethod
    def from_codes(cls, q: torch.Tensor, s: torch.Tensor) -> Q8Weight:
        """``q`` int [N, K] in [-127, 127]; ``s`` [N]."""
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"in_features must be a multiple of {GROUP}, got {k}")
        u = _blocks((q.to(torch.int16) + 128).to(torch.uint8)).reshape(-1, BLOCK, k // GROUP, 8, 4)
        packed = u.permute(0, 2, 3, 1, 4).reshape(-1, k // GROUP, 512).contiguous()
        return cls(packed, torch.nn.functional.pad(s.float(), (0, -n % BLOCK)).contiguous(), n)

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * GROUP

    def dequantize(self) -> torch.Tensor:
        nb, ng = self.packed.shape[:2]
        u = self.packed.reshape(nb, ng, 8, BLOCK, 4).permute(0, 3, 1, 2, 4).reshape(nb * BLOCK, ng * GROUP)
        return ((u.to(torch.int16) - 128).float() * self.s[:, None])[:self.out_features]

    def nbytes(self) -> int:
        return self.packed.numel() + self.s.numel() * 4


def _check(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32 [M, {k}], got {x.dtype} {list(x.shape)}")
    return x.contiguous()


def gemm_q4(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """``x [M, K] fp32 @ dequant(w).T`` -> ``[M, N]`` fp32 (activations quantized in the call)."""
    n, k = w.out_features, w.in_features
    x = _check(x, k)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    if library().tb_gemm_q4(x.data_ptr(), x.shape[0], k, w.packed.data_ptr(), n, out.data_ptr(),
                            torch.get_num_threads()):
        raise MemoryError("tb_gemm_q4: scratch allocation failed")
    return out


def gemm_q8(x: torch.Tensor, w: Q8Weight) -> torch.Tensor:
    """``x [M, K] fp32 @ dequant(w).T`` -> ``[M, N]`` fp32 (activations quantized in the call)."""
    n, k = w.out_features, w.in_features
    x = _check(x, k)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    if library().tb_gemm_q8(x.data_ptr(), x.shape[0], k, w.packed.data_ptr(), w.s.data_ptr(),
                            n, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("tb_gemm_q8: scratch allocation failed")
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' own activation quantization: (q int8 [M, K], scales fp32 [M, K / 32])."""
    x = x.float().contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8)
    d = torch.empty((m, k // GROUP), dtype=torch.float32)
    library().tb_quantize_rows(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr())
    return q, d
