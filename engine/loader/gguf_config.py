"""GGUF metadata -> :class:`ModelConfig` (architecture keys as llama.cpp's converter writes them).

Read keys, for ``<arch>`` = ``general.architecture`` (``llama`` covers Llama, Mistral and SmolLM2;
``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``phi3``, ``olmo2``, ``granite``: each family's own
switches in ``engine/loader/gguf_families.py``): ``embedding_length``, ``block_count``, ``feed_forward_length``,
``attention.head_count``, ``attention.head_count_kv``, ``attention.key_length``,
``attention.layer_norm_rms_epsilon``, ``rope.freq_base``, ``context_length``,
``rope.scaling.{type,factor,original_context_length,attn_factor,yarn_beta_fast,yarn_beta_slow}``.
Llama-3 style frequency scaling is stored by llama.cpp as a ``rope_freqs.weight`` tensor, not as
metadata; :func:`llama3_rope_scaling_from_freqs` recovers the Hugging Face dict from it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tokenbudget.engine.loader.gguf_families import GGUF_FAMILIES
from tokenbudget.engine.model.config import ModelConfig

__all__ = ["SUPPORTED_GGUF_ARCHS", "gguf_metadata_to_config", "llama3_rope_scaling_from_freqs"]

SUPPORTED_GGUF_ARCHS = tuple(GGUF_FAMILIES)


def _rope_scaling_from_metadata(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    p = f"{arch}.rope.scaling."
    kind = meta.get(p + "type")
    factor = meta.get(p + "factor")
    if kind in (None, "none") or factor in (None, 1.0) and kind != "yarn":
        return None
    out: dict[str, Any] = {"rope_type": str(kind), "factor": float(factor or 1.0)}
    if (orig := meta.get(p + "original_context_length")) is not None:
        out["original_max_position_embeddings"] = int(orig)
    for gguf_key, hf_key in (("attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                             ("yarn_beta_slow", "beta_slow")):
        if (v := meta.get(p + gguf_key)) is not None:
            out[hf_key] = float(v)
    return out


def llama3_rope_scaling_from_freqs(freqs: torch.Tensor, rope_theta: float,
                                   head_dim: int) -> dict[str, Any] | None:
    """Recover ``{"rope_type": "llama3", ...}`` from llama.cpp's ``rope_freqs`` divisors.

    llama.cpp stores, per frequency, ``inv_freq / inv_freq_llama3``. The scaling factor is the
    largest divisor; ``low_freq_factor``/``high_freq_factor``/``original_max_position_embeddings``
    are not stored, so the Llama 3.1/3.2 values are tried and the one that reproduces the tensor
    is returned. Raises ``NotImplementedError`` when none does.
    """
    freqs = freqs.to(torch.float64).flatten()
    if torch.allclose(freqs, torch.ones_like(freqs)):
        return None
    factor = float(freqs.max())
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if inv_freq.numel() != freqs.numel():
        raise NotImplementedError("rope_freqs length does not match head_dim / 2")
    for low, high, orig in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 2.0, 8192)):
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - low) / (high - low)
        div = torch.where(wavelen < orig / high, torch.ones_like(inv_freq),
                          torch.where(wavelen > orig / low, torch.full_like(inv_freq, factor),
                                      1.0 / ((1 - smooth) / factor + smooth)))
        if torch.allclose(div, freqs, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise NotImplementedError("rope_freqs.weight does not match a known llama3 rope scaling")


def gguf_metadata_to_config(meta: dict[str, Any], *, vocab_size: int, tied: bool,
                            attention_bias: bool,
                            rope_scaling: dict[str, Any] | None = None) -> ModelConfig:
    """Fill a :class:`ModelConfig` from decoded GGUF metadata.

    ``vocab_size``/``tied``/``attention_bias`` come from the tensors (the embedding's rows, the
    absence of ``output.weight``, the presence of ``attn_q.bias``); ``rope_scaling`` overrides
    the metadata's (used for llama3 ``rope_freqs``).
    """
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    eos_ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                       "tokenizer.ggml.eom_token_id") if k in meta]
    eos_ids = list(dict.fromkeys(eos_ids))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    base = dict(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling if rope_scaling is not None else _rope_scaling_from_metadata(meta, arch),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings=tied,
        attention_bias=attention_bias,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_id=(eos_ids[0] if len(eos_ids) == 1 else eos_ids) if eos_ids else None,
    )
    try:
        return ModelConfig(**{**base, **GGUF_FAMILIES[arch](meta, arch, base)})
    except (TypeError, ValueError) as e:
        raise ValueError(f"GGUF metadata of architecture {arch!r}: {e}") from None
