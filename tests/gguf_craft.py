"""GGUF files byte by byte, for the hostile-file tests (imported, not a conftest).

:class:`Spec` is a GGUF's content in Python (metadata with explicit value types, tensors with HF
order shapes and a GGML type); :func:`encode` writes it as llama.cpp lays it out (header,
key/values, tensor infos, data from the next ``alignment`` multiple, each tensor aligned), with
every field overridable, so a test writes exactly the malformed field it means.
:func:`tiny_model` is a consistent model of a family in llama.cpp's tensor layout (hidden 32,
4 heads of 8, 2 KV heads, FFN 64, 2 layers, 40 tokens), small enough to write per test.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

T = GGUFValueType
Q = GGMLQuantizationType
_FMT = {T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
        T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d"}


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw)) + raw


def value(vtype: T, v: Any) -> bytes:
    """A value's bytes; an array is ``(element type, items)``."""
    if vtype == T.STRING:
        return string(v)
    if vtype == T.ARRAY:
        elem, items = v
        return u32(elem) + u64(len(items)) + b"".join(value(elem, x) for x in items)
    return struct.pack(_FMT[vtype], v)


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One key/value pair with a raw payload (any bytes: the value as written in the file)."""
    return string(key) + u32(vtype) + payload


def tensor_info(name: str | bytes, ne: tuple[int, ...], qtype: int, offset: int) -> bytes:
    """A tensor info; ``ne`` in GGUF order (ne0 first)."""
    return string(name) + u32(len(ne)) + b"".join(u64(d) for d in ne) + u32(qtype) + u64(offset)


def nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    count = 1
    for d in shape:
        count *= d
    return count // block * size


@dataclass
class Spec:
    """A GGUF's content: ``meta`` key -> (value type, value); ``tensors`` name -> (HF order shape,
    type). ``raw_kvs`` are appended to the key/values as given (malformed ones)."""

    meta: dict[str, tuple[T, Any]] = field(default_factory=dict)
    tensors: dict[str, tuple[tuple[int, ...], Q]] = field(default_factory=dict)
    raw_kvs: list[bytes] = field(default_factory=list)
    alignment: int = 32


def encode(spec: Spec, *, version: int = 3, n_tensors: int | None = None, n_kv: int | None = None,
           offsets: dict[str, int] | None = None, data_size: int | None = None) -> bytes:
    """The file's bytes. ``offsets`` overrides tensor offsets; ``data_size`` the bytes of data
    written (default: what the tensors need)."""
    kvs = [kv(k, t, value(t, v)) for k, (t, v) in spec.meta.items()] + spec.raw_kvs
    infos, offset, placed = [], 0, {}
    for name, (shape, qtype) in spec.tensors.items():
        placed[name] = offset
        offset += -(-nbytes(shape, qtype) // spec.alignment) * spec.alignment
    placed.update(offsets or {})
    for name, (shape, qtype) in spec.tensors.items():
        infos.append(tensor_info(name, tuple(reversed(shape)), qtype, placed[name]))
    head = (b"GGUF" + u32(version) + u64(len(infos) if n_tensors is None else n_tensors)
            + u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos))
    head += bytes(-len(head) % spec.alignment)
    return head + bytes(offset if data_size is None else data_size)


N_TOKENS = 40
_LAYER = {  # llama.cpp's names -> HF order shapes of the tiny model (hidden 32, 4 x 8 heads, 2 KV, FFN 64)
    "attn_norm.weight": (32,), "attn_q.weight": (32, 32), "attn_k.weight": (16, 32), "attn_v.weight": (16, 32),
    "attn_output.weight": (32, 32), "ffn_norm.weight": (32,), "ffn_gate.weight": (64, 32),
    "ffn_up.weight": (64, 32), "ffn_down.weight": (32, 64)}
_FAMILY = {  # per family: (tensors added, tensors dropped), as llama.cpp's converter writes them
    "llama": ({}, ()),
    "qwen2": ({"attn_q.bias": (32,), "attn_k.bias": (16,), "attn_v.bias": (16,)}, ()),
    "qwen3": ({"attn_q_norm.weight": (8,), "attn_k_norm.weight": (8,)}, ()),
    "gemma2": ({"post_attention_norm.weight": (32,), "post_ffw_norm.weight": (32,)}, ()),
    "gemma3": ({"post_attention_norm.weight": (32,), "post_ffw_norm.weight": (32,), "attn_q_norm.weight": (8,),
                "attn_k_norm.weight": (8,)}, ()),
    "olmo2": ({"post_attention_norm.weight": (32,), "post_ffw_norm.weight": (32,), "attn_q_norm.weight": (32,),
               "attn_k_norm.weight": (16,)}, ("attn_norm.weight", "ffn_norm.weight")),
    "phi3": ({"attn_qkv.weight": (64, 32), "ffn_up.weight": (128, 32)},
             ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight")),
}
FAMILIES = tuple(_FAMILY)


def tiny_model(arch: str = "llama", qtype: Q = Q.F32, layers: int = 2) -> Spec:
    """A consistent tiny model of ``arch`` (module doc); 2-D weights of type ``qtype``."""
    p = f"{arch}."
    meta: dict[str, tuple[T, Any]] = {
        "general.architecture": (T.STRING, arch),
        p + "block_count": (T.UINT32, layers), p + "context_length": (T.UINT32, 64),
        p + "embedding_length": (T.UINT32, 32), p + "feed_forward_length": (T.UINT32, 64),
        p + "attention.head_count": (T.UINT32, 4), p + "attention.head_count_kv": (T.UINT32, 2),
        p + "attention.layer_norm_rms_epsilon": (T.FLOAT32, 1e-5), p + "rope.freq_base": (T.FLOAT32, 10000.0),
        "tokenizer.ggml.model": (T.STRING, "gpt2"),
        "tokenizer.ggml.tokens": (T.ARRAY, (T.STRING, [f"t{i}" for i in range(N_TOKENS)])),
        "tokenizer.ggml.token_type": (T.ARRAY, (T.INT32, [1] * N_TOKENS)),
        "tokenizer.ggml.merges": (T.ARRAY, (T.STRING, ["t 1"])),
        "tokenizer.ggml.bos_token_id": (T.UINT32, 0), "tokenizer.ggml.eos_token_id": (T.UINT32, 1),
    }
    added, dropped = _FAMILY[arch]
    layer = {**{k: v for k, v in _LAYER.items() if k not in dropped}, **added}
    tensors = {"token_embd.weight": ((N_TOKENS, 32), qtype)}
    for i in range(layers):
        tensors.update({f"blk.{i}.{name}": (shape, qtype if len(shape) == 2 else Q.F32)
                        for name, shape in layer.items()})
    tensors["output_norm.weight"] = ((32,), Q.F32)
    return Spec(meta, tensors)
