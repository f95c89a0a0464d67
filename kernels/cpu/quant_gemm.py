"""torch-facing side of ``quant_gemm.c``: weight packing and the two GEMM calls.

Formats (the C file's header has the details): ``Q4Weight`` is GGUF Q4_1's arithmetic
(``w = q * d + m`` per group of 32 input columns, q in [0, 15], fp16 d and m) with each 64
columns' nibbles and scales in one 40-byte record; ``Q8Weight`` is symmetric int8 per output channel,
stored offset by +128. Activations are quantized per row and group of 32 inside the call.
``dequantize`` of either gives the weights the kernel multiplies by, for references in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbudget.kernels.cpu.native import library

GROUP = 32
CHUNK = 64


def supports(in_features: int) -> bool:
    """Whether the C kernels can run a linear with this K (and are available at all)."""
    return in_features % CHUNK == 0 and library() is not None


@dataclass(slots=True, frozen=True)
class Q4Weight:
    """``packed`` uint8 ``[N, K / 64, 40]``: per 64 columns, 32 bytes of nibbles (byte i = column i
    low, column 32 + i high) then fp16 ``d0, d1, m0, m1`` of its two groups."""

    packed: torch.Tensor

    @classmethod
    def from_codes(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4Weight:
        """``q`` int [N, K] in [0, 15]; ``d``, ``m`` [N, K / 32] (stored as fp16, GGUF Q4_1's)."""
        n, k = q.shape
        if k % CHUNK:
            raise ValueError(f"in_features must be a multiple of {CHUNK}, got {k}")
        c = q.to(torch.uint8).reshape(n, k // CHUNK, 2, GROUP)
        nibbles = c[:, :, 0] | (c[:, :, 1] << 4)                                   # [N, C, 32]
        dm = torch.stack([d.reshape(n, -1, 2), m.reshape(n, -1, 2)], 2).to(torch.float16)  # [N, C, 2, 2]
        return cls(torch.cat([nibbles, dm.reshape(n, k // CHUNK, 4).view(torch.uint8)], -1).contiguous())

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * CHUNK

    def codes(self) -> torch.Tensor:
        n = self.packed.shape[0]
        p = self.packed[:, :, :GROUP].reshape(n, -1, 1, GROUP)
        return torch.cat([p & 0x0F, p >> 4], dim=2).reshape(n, -1)

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.packed.shape[0]
        dm = self.packed[:, :, GROUP:].contiguous().view(torch.float16).float().reshape(n, -1, 2, 2)
        return dm[:, :, 0].reshape(n, -1), dm[:, :, 1].reshape(n, -1)

    def dequantize(self) -> torch.Tensor:
        n = self.packed.shape[0]
        d, m = self.scales_and_mins()
        q = self.codes().float().reshape(n, -1, GROUP)
        return (q * d[..., None] + m[..., None]).reshape(n, -1)

    def nbytes(self) -> int:
        return self.packed.numel()


@dataclass(slots=True, frozen=True)
class Q8Weight:
    packed: torch.Tensor  # uint8 [N, K] = q + 128
    s: torch.Tensor       # fp32 [N]

    @classmethod
    def from_codes(cls, q: torch.Tensor, s: torch.Tensor) -> Q8Weight:
        """``q`` int [N, K] in [-127, 127]; ``s`` [N]."""
        if q.shape[1] % CHUNK:
            raise ValueError(f"in_features must be a multiple of {CHUNK}, got {q.shape[1]}")
        return cls((q.to(torch.int16) + 128).to(torch.uint8).contiguous(), s.float().contiguous())

    def dequantize(self) -> torch.Tensor:
        return (self.packed.to(torch.int16) - 128).float() * self.s[:, None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.s))


def _check(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32 [M, {k}], got {x.dtype} {list(x.shape)}")
    return x.contiguous()


def gemm_q4(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """``x [M, K] fp32 @ dequant(w).T`` -> ``[M, N]`` fp32 (activations quantized in the call)."""
    n, k = w.packed.shape[0], w.in_features
    x = _check(x, k)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    if library().tb_gemm_q4(x.data_ptr(), x.shape[0], k, w.packed.data_ptr(), n, out.data_ptr(),
                            torch.get_num_threads()):
        raise MemoryError("tb_gemm_q4: scratch allocation failed")
    return out


def gemm_q8(x: torch.Tensor, w: Q8Weight) -> torch.Tensor:
    """``x [M, K] fp32 @ dequant(w).T`` -> ``[M, N]`` fp32 (activations quantized in the call)."""
    n, k = w.packed.shape
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
