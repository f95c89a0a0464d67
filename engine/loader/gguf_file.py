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

The file is untrusted (an operator may load one from anywhere), so every malformed input is a
``ValueError`` naming the file, the key or tensor, and the byte offset; nothing else escapes
(no ``struct.error``, ``UnicodeDecodeError``, ``IndexError``, recursion, overflow). Every count
is checked against the bytes left before it is looped over or allocated (each entry needs at
least a known number of bytes), so no allocation exceeds a small multiple of the file's size.
Tensors must lie inside the file, aligned, without overlapping. As in llama.cpp, arrays of arrays
are refused (no model writes them), tensors have 1 to 4 dimensions, each at least 1.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALARS = {kind: struct.Struct(fmt) for kind, fmt in
            {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
             12: "<d"}.items()}
_NUMPY = {0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
          5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"), 10: np.dtype("<u8"), 11: np.dtype("<i8"),
          12: np.dtype("<f8")}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}
_HEADER = 24                        # magic, version, tensor count, key/value count
_MIN_KV = 8 + 4 + 1                 # key length, value type, the smallest value (u8/i8/bool)
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, dims, one dim, type, offset
_MAX_DIMS = 4                       # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32


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


class _Malformed(Exception):
    """Raised inside the parser; the loop that knows the key or tensor turns it into a ValueError."""

    def __init__(self, message: str, pos: int) -> None:
        super().__init__(message)
        self.pos = pos


class _Cursor:
    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf) -> None:
        self.buf, self.pos, self.end = buf, 0, len(buf)

    def _need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise _Malformed(f"{what} needs {n} bytes, the file has {self.end - self.pos} left", self.pos)

    def u32(self, what: str) -> int:
        self._need(4, what)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self._need(8, what)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self._need(n, f"{what} ({n} bytes)")
        try:
            s = str(self.buf[self.pos:self.pos + n], "utf-8")
        except UnicodeDecodeError as exc:
            raise _Malformed(f"{what} is not valid UTF-8 ({exc.reason} at its byte {exc.start})",
                             self.pos) from None
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            self._need(fmt.size, "the value")
            v = fmt.unpack_from(self.buf, self.pos)[0]
            self.pos += fmt.size
            return v
        if kind == _STRING:
            return self.string("the string value")
        if kind != _ARRAY:
            raise _Malformed(f"unknown value type {kind}", self.pos - 4)
        elem = self.u32("the array's element type")
        n = self.u64("the array's length")
        if elem in _NUMPY:
            dtype = _NUMPY[elem]
            self._need(n * dtype.itemsize, f"an array of {n} {dtype.name}")
            arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        if elem == _STRING:
            return self._strings(n)
        if elem == _ARRAY:
            raise _Malformed("arrays of arrays are not supported", self.pos - 12)
        raise _Malformed(f"unknown array element type {elem}", self.pos - 12)

    def _strings(self, n: int) -> list[str]:
        """``n`` strings; the hot loop of a vocabulary (~100k strings), so bounds are checked
        inline and only a failure builds a message."""
        buf, pos, end = self.buf, self.pos, self.end
        if n > (end - pos) // 8:
            raise _Malformed(f"an array of {n} strings needs at least {8 * n} bytes, the file has "
                             f"{end - pos} left", pos)
        out: list[str] = [""] * n
        unpack = _U64.unpack_from
        i = 0
        try:
            for i in range(n):
                length = unpack(buf, pos)[0]  # struct.error past the end
                pos += 8
                if length > end - pos:
                    raise _Malformed(f"string {i} of the array ({length} bytes) runs past the end of the "
                                     "file", pos - 8)
                out[i] = str(buf[pos:pos + length], "utf-8")
                pos += length
        except struct.error:
            raise _Malformed(f"the file ends inside string {i} of the array", pos) from None
        except UnicodeDecodeError as exc:
            raise _Malformed(f"string {i} of the array is not valid UTF-8 ({exc.reason})", pos) from None
        self.pos = pos
        return out


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse the file at ``path`` (memory-mapped; tensor data stays in the file until used).
    ValueError naming the file, the field and the byte offset when it is not a valid GGUF v2/v3."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < _HEADER:
            raise ValueError(f"{path}: not a GGUF file ({os.fstat(f.fileno()).st_size} bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return parse_gguf(buf, path)


def parse_gguf(buf, path: str = "<bytes>") -> GGUFFile:
    """Parse GGUF bytes (``bytes``, ``mmap`` or any buffer); ``path`` names it in errors."""
    if len(buf) < _HEADER or bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    cur = _Cursor(buf)
    version = _U32.unpack_from(buf, 4)[0]
    if version not in (2, 3):
        endian = " (a big-endian file?)" if int.from_bytes(bytes(buf[4:8]), "big") in (2, 3) else ""
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3){endian}")
    n_tensors, n_kv = _U64.unpack_from(buf, 8)[0], _U64.unpack_from(buf, 16)[0]
    cur.pos = _HEADER
    left = len(buf) - _HEADER
    if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO > left:
        raise ValueError(f"{path}: header: {n_tensors} tensors and {n_kv} key/value pairs need at least "
                         f"{n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO} bytes, the file has {left} "
                         "after the header (byte 8)")
    metadata = _read_metadata(cur, n_kv, path)
    alignment = _alignment(metadata, path)
    infos = _read_tensor_infos(cur, n_tensors, alignment, path)
    start = -(-cur.pos // alignment) * alignment
    tensors = _place_tensors(buf, start, infos, alignment, path)
    return GGUFFile(path, metadata, tensors)


def _read_metadata(cur: _Cursor, n_kv: int, path: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        at, key = cur.pos, None
        try:
            key = cur.string(f"the key of key/value pair {i}")
            if key in metadata:
                raise _Malformed("the key appears twice", at)
            metadata[key] = cur.value(cur.u32("the value type"))
        except _Malformed as exc:
            where = f"key {key!r}" if key is not None else f"key/value pair {i}"
            raise ValueError(f"{path}: {where}: {exc} (byte {exc.pos})") from None
    return metadata


def _alignment(metadata: dict[str, Any], path: str) -> int:
    align = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if (type(align) is not int or not 1 <= align < 2**32 or align & (align - 1)):
        raise ValueError(f"{path}: key 'general.alignment': {align!r} is not a power of two below 2**32")
    return align


def _read_tensor_infos(cur: _Cursor, n_tensors: int, alignment: int, path: str
                       ) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]]:
    """``(name, dims, type, offset, nbytes)`` per tensor, each checked on its own."""
    infos, names = [], set()
    for i in range(n_tensors):
        at, name = cur.pos, None
        try:
            name = cur.string(f"the name of tensor {i}")
            if name in names:
                raise _Malformed("the tensor name appears twice", at)
            names.add(name)
            n_dims = cur.u32("the number of dimensions")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise _Malformed(f"{n_dims} dimensions (1 to {_MAX_DIMS} are allowed)", cur.pos - 4)
            dims = tuple(cur.u64("a dimension") for _ in range(n_dims))
            kind = cur.u32("the tensor type")
            offset = cur.u64("the data offset")
            infos.append((name, dims, *_tensor_layout(name, dims, kind, offset, alignment, cur.pos - 12)))
        except _Malformed as exc:
            where = f"tensor {name!r}" if name is not None else f"tensor info {i}"
            raise ValueError(f"{path}: {where}: {exc} (byte {exc.pos})") from None
    return infos


def _tensor_layout(name: str, dims: tuple[int, ...], kind: int, offset: int, alignment: int,
                   at: int) -> tuple[GGMLQuantizationType, int, int]:
    """``(type, offset, nbytes)`` of one tensor info; _Malformed for a shape no tensor can have."""
    if any(not 1 <= d < 2**63 for d in dims):
        raise _Malformed(f"shape {list(dims)}: every dimension must be at least 1 and below 2**63", at)
    count = 1
    for d in dims:
        count *= d
    if count >= 2**63:
        raise _Malformed(f"shape {list(dims)} has {count} elements, more than an int64 holds", at)
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise _Malformed(f"unknown tensor type {kind}", at) from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise _Malformed(f"a {qtype.name} row of {dims[0]} values is not a whole number of {block}-value "
                         "blocks", at)
    if offset % alignment:
        raise _Malformed(f"data offset {offset} is not a multiple of general.alignment = {alignment}", at + 4)
    return qtype, offset, count // block * type_size


def _place_tensors(buf, start: int, infos, alignment: int, path: str) -> list[GGUFTensor]:
    """Views of each tensor's bytes, once every tensor is known to lie inside the file and no two
    overlap (the views alias the mapped file, so two would alias each other)."""
    size = len(buf)
    prev_end, prev_name = 0, None
    for name, _, _, offset, nbytes in sorted(infos, key=lambda info: info[3]):
        if start + offset + nbytes > size:
            raise ValueError(f"{path}: tensor {name!r}: its data (bytes {start + offset} to {start + offset + nbytes}"
                             f") runs past the end of the file ({size} bytes; data starts at byte {start}, "
                             f"general.alignment = {alignment})")
        if offset < prev_end:
            raise ValueError(f"{path}: tensor {name!r}: its data (offset {offset}) overlaps tensor "
                             f"{prev_name!r}'s (which ends at offset {prev_end})")
        prev_end, prev_name = offset + nbytes, name
    return [GGUFTensor(name, qtype, dims, _tensor_data(buf, start + offset, dims, qtype))
            for name, dims, qtype, offset, _ in infos]


def _tensor_data(buf, offset: int, dims: tuple[int, ...], qtype: GGMLQuantizationType) -> np.ndarray:
    rows = tuple(reversed(dims))
    if qtype in _FLOAT_DTYPES:
        count = 1
        for d in rows:
            count *= d
        return np.frombuffer(buf, dtype=_FLOAT_DTYPES[qtype], count=count, offset=offset).reshape(rows)
    block, type_size = GGML_QUANT_SIZES[qtype]
    byte_rows = (*rows[:-1], rows[-1] // block * type_size)
    count = 1
    for d in byte_rows:
        count *= d
    return np.frombuffer(buf, dtype=np.uint8, count=count, offset=offset).reshape(byte_rows)
