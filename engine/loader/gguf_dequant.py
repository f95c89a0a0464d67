"""Dequantize GGUF tensor data to torch.

Vectorized torch paths cover the types that dominate load time (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1); every other type the ``gguf`` package knows (the K-quants Q2_K..Q6_K, IQ*)
goes through ``gguf.quants.dequantize`` (numpy), the reference the torch paths are tested
against. Block layouts follow ggml-common.h: each block is a little-endian f16 scale ``d``
(plus an f16 minimum ``m`` for the ``_1`` types, plus 4 bytes of fifth bits ``qh`` for the
``Q5`` types) followed by the packed quants; within a 32-element block the low nibbles hold
elements 0..15 and the high nibbles elements 16..31.

The input is the raw array a ``gguf.GGUFReader`` tensor exposes (``ReaderTensor.data``): a typed
array for float types, a ``uint8`` array of shape ``(*rows, bytes_per_row)`` for block types.
The output shape is the numpy (row-major) shape, i.e. GGUF ``ne`` reversed, which for weight
matrices equals the Hugging Face ``(out_features, in_features)`` layout.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize

Q = GGMLQuantizationType

__all__ = ["dequantize_tensor", "dequantize_blocks_torch", "TORCH_DEQUANT_TYPES"]


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Read a little-endian f16 at byte ``start`` of each block, as float32 of shape (n, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) packed bytes -> (n, 32) float32 values 0..15: low nibbles first, then high."""
    out = torch.empty(qs.shape[0], 2, 16, dtype=torch.float32)
    out[:, 0] = qs & 0x0F
    out[:, 1] = qs >> 4
    return out.view(qs.shape[0], 32)


def _fifth_bits(qh_bytes: torch.Tensor) -> torch.Tensor:
    """(n, 4) little-endian uint32 ``qh`` -> (n, 32) float32 ``16 * bit j`` for element j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (qh_bytes.unsqueeze(-1) >> shifts) & 1  # (n, 4, 8): byte b bit s -> element 8b+s
    return bits.reshape(qh_bytes.shape[0], 32).to(torch.float32).mul_(16.0)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32).mul_(d)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:]).sub_(8.0).mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    return torch.addcmul(m, _nibbles(b[:, 4:]), d)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:]).add_(_fifth_bits(b[:, 2:6])).sub_(16.0).mul_(d)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    return torch.addcmul(m, _nibbles(b[:, 8:]).add_(_fifth_bits(b[:, 4:8])), d)


_BLOCK_FNS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
}

TORCH_DEQUANT_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {Q.F32, Q.F16, Q.BF16, *_BLOCK_FNS}
)


def dequantize_blocks_torch(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Dequantize a ``uint8`` array of whole blocks of ``qtype`` with torch (float32).

    ``raw`` has shape ``(*rows, bytes_per_row)``; the result has shape ``(*rows, elems_per_row)``.
    Raises ``NotImplementedError`` for a type without a torch path.
    """
    fn = _BLOCK_FNS.get(qtype)
    if fn is None:
        raise NotImplementedError(f"no torch dequantization for {qtype.name}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = torch.from_numpy(np.array(raw, copy=True)) if isinstance(raw, np.ndarray) else raw
    if data.dtype != torch.uint8 or data.shape[-1] % type_size:
        raise ValueError(f"{qtype.name} data must be uint8 with rows of whole {type_size}-byte blocks")
    rows = data.shape[:-1]
    n_blocks = data.shape[-1] // type_size
    out = fn(data.reshape(-1, type_size))
    return out.reshape(*rows, n_blocks * block_size)


def dequantize_tensor(data: np.ndarray, qtype: GGMLQuantizationType,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize the raw data of one GGUF tensor to a ``dtype`` torch tensor (row-major shape).

    F32/F16/BF16 and Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 use torch; any other type the ``gguf`` package
    can dequantize uses its numpy reference. The result never aliases the (memory-mapped) file.
    """
    if qtype in (Q.F32, Q.F16):
        t = torch.from_numpy(np.array(data, copy=True))
        return t.to(dtype)
    if qtype == Q.BF16:
        raw = np.ascontiguousarray(data).view(np.uint8)
        shape = raw.shape[:-1] + (raw.shape[-1] // 2,)
        t = torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(shape)
        return t.to(dtype)
    if qtype in _BLOCK_FNS:
        return dequantize_blocks_torch(data, qtype).to(dtype)
    try:
        out = np_dequantize(np.ascontiguousarray(data), qtype)
    except NotImplementedError as exc:
        raise NotImplementedError(f"GGUF tensor type {qtype.name} is not supported") from exc
    return torch.from_numpy(np.array(out, dtype=np.float32, copy=True)).to(dtype)
