"""Load a ``.gguf`` file: metadata -> ModelConfig, tensors -> HF-named state dict, tokenizer.

Tensor names are mapped from llama.cpp's (``token_embd``, ``blk.N.attn_q`` ...) to Hugging Face's
(``model.embed_tokens``, ``model.layers.N.self_attn.q_proj`` ...); the embeddings are tied when
``output.weight`` is absent. llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` for
the ``llama`` architecture (interleaved rotary pairs, ``w.reshape(n_head, 2, d // n_head // 2,
*rest).swapaxes(1, 2)``); :func:`unpermute_qk` undoes it so the weights match HF's half-split
rotary layout (``granite`` files too); the other architectures are written unpermuted. Which
GGUF norm fills which HF role is the family's (``engine/loader/gguf_families.py``).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from tokenbudget.engine.loader.gguf_config import (
    gguf_metadata_to_config,
    llama3_rope_scaling_from_freqs,
)
from tokenbudget.engine.loader.gguf_dequant import dequantize_tensor
from tokenbudget.engine.loader.gguf_families import PERMUTED_QK, block_names
from tokenbudget.engine.loader.gguf_file import GGUFFile, read_gguf
from tokenbudget.engine.loader.model_checks import check_gguf_model
from tokenbudget.engine.loader.weight_quant import block_weight_type
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.text.gguf_tokenizer import build_gguf_tokenizer
from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["read_gguf_metadata", "gguf_tensor_name_to_hf", "unpermute_qk", "load_gguf"]

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def read_gguf_metadata(source: str | os.PathLike[str] | GGUFFile) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (a path or a parsed :class:`GGUFFile`) as Python values."""
    return (source if isinstance(source, GGUFFile) else read_gguf(source)).metadata


def gguf_tensor_name_to_hf(name: str, arch: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name of architecture ``arch``; None for tensors with
    no HF counterpart."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    names = block_names(arch)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def _longrope(meta: dict[str, Any], arch: str, tensors) -> dict[str, Any] | None:
    """Phi-3's longrope from its ``rope_factors_long/short`` tensors (llama.cpp keeps the factors
    as tensors, the original context length and attention factor as metadata)."""
    if "rope_factors_long.weight" not in tensors:
        return None
    factors = {k: dequantize_tensor(tensors[f"rope_factors_{k}.weight"].data,
                                    tensors[f"rope_factors_{k}.weight"].tensor_type).flatten().tolist()
               for k in ("long", "short")}
    out = {"rope_type": "longrope", "long_factor": factors["long"], "short_factor": factors["short"],
           "original_max_position_embeddings": int(meta.get(f"{arch}.rope.scaling.original_context_length",
                                                            meta.get(f"{arch}.context_length", 4096)))}
    if (attn := meta.get(f"{arch}.rope.scaling.attn_factor")) is not None:
        out["attention_factor"] = float(attn)
    return out


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute`` of q/k projection rows (weights or biases)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows over {n_head} heads")
    rest = w.shape[1:]
    return (w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2)
            .reshape(w.shape).contiguous())


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, str | None]:
    """Read ``path`` and return ``(config, state_dict, tokenizer, weight_type)`` with HF names and
    layout; ``weight_type`` is the GGUF type most block weights have (``quantization=auto``).

    Raises ``NotImplementedError`` for an unsupported architecture, tensor type or tokenizer,
    ``ValueError`` for an unexpected tensor.
    """
    reader = read_gguf(path)
    check_gguf_model(reader)  # metadata against the tensor shapes, before anything is dequantized
    meta = reader.metadata
    arch = str(meta.get("general.architecture", ""))
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    embd = tensors["token_embd.weight"]
    vocab_size = int(embd.shape[1]) if len(embd.shape) > 1 else len(meta.get("tokenizer.ggml.tokens", []))
    rope_scaling = None
    if "rope_freqs.weight" in tensors:
        head_dim = int(meta.get(f"{arch}.rope.dimension_count") or
                       int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"]))
        freqs = dequantize_tensor(tensors["rope_freqs.weight"].data,
                                  tensors["rope_freqs.weight"].tensor_type)
        rope_scaling = llama3_rope_scaling_from_freqs(freqs, float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
                                                      head_dim)
    rope_scaling = _longrope(meta, arch, tensors) or rope_scaling
    config = gguf_metadata_to_config(
        meta, vocab_size=vocab_size, tied="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors, rope_scaling=rope_scaling)
    tokenizer = build_gguf_tokenizer(meta)

    state_dict: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in _ROPE_TENSORS:
            continue
        hf_name = gguf_tensor_name_to_hf(name, arch)
        if hf_name is None:
            raise ValueError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}")
        w = dequantize_tensor(t.data, t.tensor_type, dtype)
        if arch in PERMUTED_QK and (".q_proj." in hf_name or ".k_proj." in hf_name):
            n_head = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            w = unpermute_qk(w, n_head)
        state_dict[hf_name] = w
    return config, state_dict, tokenizer, block_weight_type(reader.tensors)

