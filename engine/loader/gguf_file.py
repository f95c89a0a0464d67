"""A GGUF file read in one pass: key/value metadata as Python values, tensors as numpy views.

Why not ``gguf.GGUFReader``: it builds a numpy memmap view for every part of every field, ~0.5 M
views for a 49k-token vocabulary, and took 2 s of the default model's ~5 s start-up (twice, when
``quantization=auto`` read the file again). Here strings are decoded straight from the mapped
bytes and numeric arrays with one ``np.frombuffer``: the same metadata in ~0.1 s.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 key/value
count; key/value pairs (string key, u32 value type, value); tensor infos (string name, u32 dims,
u64 ``ne[dims]``, u32 type, u64 offset); tensor data from the next multiple of
``general.alignment`` (default 32). :class:`GGUFTensor` mirrors ``gguf.ReaderTensor``: ``shape`` in
GGUF order (``ne0`` first), ``data`` row-major (reversed shape), raw ``uint8`` bytes per row for
block-quantized types, so ``gguf_dequant`` takes either.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]   # GGUF order: ne0 (the contiguous dimension) first
    data: np.ndarray         # read-only view of the mapped file, row-major


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"GGUF: unknown value type {kind} at byte {self.pos}")
        elem, n = self.unpack("<I"), self.unpack("<Q")
        if elem in _NUMPY:
            arr = np.frombuffer(self.buf, dtype=_NUMPY[elem], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        return [self.value(elem) for _ in range(n)]


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse ``path``; ValueError when it is not a GGUF v2/v3 file."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if len(buf) < 24 or buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    version = cur.unpack("<4xI")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
    align = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = [GGUFTensor(name, qtype, dims, _tensor_data(buf, start + offset, dims, qtype))
               for name, dims, qtype, offset in infos]
    return GGUFFile(path, metadata, tensors)


def _tensor_data(buf, offset: int, dims: tuple[int, ...], qtype: GGMLQuantizationType) -> np.ndarray:
    rows = tuple(reversed(dims))
    if qtype in _FLOAT_DTYPES:
        dtype = np.dtype(_FLOAT_DTYPES[qtype])
        count = int(np.prod(rows, dtype=np.int64))
        return np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(rows)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if rows[-1] % block:
        raise ValueError(f"GGUF: a {qtype.name} row of {rows[-1]} values is not whole {block}-value blocks")
    byte_rows = (*rows[:-1], rows[-1] // block * type_size)
    count = int(np.prod(byte_rows, dtype=np.int64))
    return np.frombuffer(buf, dtype=np.uint8, count=count, offset=offset).reshape(byte_rows)
