"""Per-architecture GGUF facts: which ModelConfig switches a ``general.architecture`` turns on,
read from the metadata keys llama.cpp's converter writes, and how its tensor names map to the
Hugging Face names the model reads (``engine/model/weights.py``). The GGUF half of
``engine/loader/hf_config.py``; the same switches for the same family.

Where llama.cpp hard-codes a value instead of storing it, it is derived here as llama.cpp's
``llama-model.cpp`` does, and said so:

* Gemma 2/3: the embedding scale sqrt(hidden); the attention scale 1/sqrt(head_dim), except the
  27B models (1/sqrt(hidden / heads); recognised by their layer counts, 46 for Gemma 2 and 62 for
  Gemma 3, as llama.cpp recognises its model types); sliding layers every layer but each 2nd
  (Gemma 2) or 6th (Gemma 3); Gemma 3's sliding layers rotate with base 10000 and no scaling.
  Gemma's norms are stored with the ``+ 1`` already added (``norm_weight_offset`` 0 here).
* Phi-3 long-context files carry their longrope factors as ``rope_factors_long/short`` tensors.
* ``llama`` and ``granite`` files hold q/k rows permuted for interleaved RoPE (``unpermute_qk``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["GGUF_FAMILIES", "PERMUTED_QK", "block_names"]

PERMUTED_QK = ("llama", "granite")

_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_SANDWICH = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_POST = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def block_names(arch: str) -> dict[str, str]:
    """GGUF block tensor stem (``attn_q``) -> HF name under ``model.layers.N.`` for ``arch``."""
    norms = {"gemma2": _SANDWICH, "gemma3": _SANDWICH, "olmo2": _POST}.get(arch, _PRE)
    names = {**_ATTN, **norms}
    if arch == "phi3":  # a fused gate+up in ffn_up
        names["ffn_up"] = "mlp.gate_up_proj"
    return names


def _key(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    return meta.get(f"{arch}.{key}", default)


def _gemma(meta: dict[str, Any], arch: str, base: dict[str, Any], pattern: int, big_layers: int) -> dict[str, Any]:
    hidden, heads = base["hidden_size"], base["num_attention_heads"]
    head_dim = base["head_dim"] or hidden // heads
    scalar = hidden // heads if base["num_hidden_layers"] == big_layers else head_dim  # llama.cpp's rule
    n = base["num_hidden_layers"]
    window = _key(meta, arch, "attention.sliding_window")
    return dict(hidden_act="gelu_pytorch_tanh", norm_layout="sandwich", embedding_multiplier=hidden ** 0.5,
                attention_scale=float(scalar) ** -0.5, sliding_window=int(window) if window else None,
                layer_types=tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)),
                attn_logit_softcapping=_key(meta, arch, "attn_logit_softcapping"),
                final_logit_softcapping=_key(meta, arch, "final_logit_softcapping"))


def _gemma2(meta, arch, base):
    return _gemma(meta, arch, base, 2, 46)


def _gemma3(meta, arch, base):
    return dict(_gemma(meta, arch, base, 6, 62), qk_norm="head", sliding_rope_theta=10000.0)


def _qwen3(meta, arch, base):
    return dict(qk_norm="head")


def _olmo2(meta, arch, base):
    return dict(norm_layout="post", qk_norm="proj")


def _phi3(meta, arch, base):
    window = _key(meta, arch, "attention.sliding_window")
    rot = _key(meta, arch, "rope.dimension_count")
    head_dim = base["head_dim"] or base["hidden_size"] // base["num_attention_heads"]
    return dict(sliding_window=int(window) if window else None,
                partial_rotary_factor=int(rot) / head_dim if rot else 1.0)


def _granite(meta, arch, base):
    return dict(embedding_multiplier=float(_key(meta, arch, "embedding_scale", 1.0)),
                residual_multiplier=float(_key(meta, arch, "residual_scale", 1.0)),
                attention_scale=float(_key(meta, arch, "attention.scale", base["head_dim"] ** -0.5
                                       if base["head_dim"] else 1.0)),
                logits_scaling=float(_key(meta, arch, "logit_scale", 1.0)))


def _plain(meta, arch, base):
    return {}


GGUF_FAMILIES: dict[str, Callable[[dict[str, Any], str, dict[str, Any]], dict[str, Any]]] = {
    "llama": _plain, "qwen2": _plain, "qwen3": _qwen3, "gemma2": _gemma2, "gemma3": _gemma3,
    "phi3": _phi3, "olmo2": _olmo2, "granite": _granite,
}
