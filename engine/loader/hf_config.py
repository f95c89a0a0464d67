"""A Hugging Face ``config.json`` -> :class:`ModelConfig`, one small reader per family.

Both transformers 4.x spellings (``rope_theta`` + ``rope_scaling``, Gemma 3's
``rope_local_base_freq`` and ``sliding_window_pattern``) and 5.x ones (``rope_parameters``, per
layer type for Gemma 3; ``layer_types``) are read; where a key is absent, the family's transformers
default applies (written here, so transformers is not needed at run time). ``rope_scaling`` is
normalised to a dict that always carries ``rope_type`` (``None`` for plain RoPE).

A multimodal checkpoint whose language model is a supported family (Gemma 3's 4B-27B) loads its
text model alone (``TEXT_MODELS``): the vision tower's tensors are never read.

Adding a family: a reader below that maps its config keys onto the switches of
:class:`ModelConfig` (docs/DESIGN.md, "Model families"); the weights side reads the switches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenbudget.engine.model.config import ModelConfig

__all__ = ["SUPPORTED_HF_ARCHS", "TEXT_MODELS", "hf_config_to_model_config", "text_model_config", "text_tensor_name"]


def _rope(params: Any, cfg: dict[str, Any], theta_default: float) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling or None)`` from a rope-parameters dict (5.x) or the 4.x keys."""
    scaling = dict(params) if isinstance(params, dict) else dict(cfg.get("rope_scaling") or {})
    theta = float(scaling.pop("rope_theta", cfg.get("rope_theta", theta_default)))
    scaling.pop("partial_rotary_factor", None)  # a ModelConfig field of its own
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if not scaling or scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _rope_params(cfg: dict[str, Any], layer_type: str | None = None) -> Any:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        return params.get(layer_type or "full_attention")
    return params


def _eos(cfg: dict[str, Any], generation_config: dict[str, Any] | None) -> Any:
    """config.json's EOS ids plus generation_config.json's (transformers' ``generate`` stops at both)."""
    eos: Any = cfg.get("eos_token_id")
    gen_eos = (generation_config or {}).get("eos_token_id")
    if gen_eos is not None:
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        ids = list(dict.fromkeys(ids))
        eos = ids[0] if len(ids) == 1 else ids
    return eos


def _common(cfg: dict[str, Any], theta_default: float = 10000.0, eps_default: float = 1e-6) -> dict[str, Any]:
    theta, scaling = _rope(_rope_params(cfg), cfg, theta_default)
    heads = int(cfg["num_attention_heads"])
    params = _rope_params(cfg) if isinstance(_rope_params(cfg), dict) else {}
    return dict(
        architecture=cfg["model_type"],
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", eps_default)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
    )


def _layer_types(cfg: dict[str, Any], default: Callable[[int], str]) -> tuple[str, ...]:
    n = int(cfg["num_hidden_layers"])
    return tuple(cfg.get("layer_types") or [default(i) for i in range(n)])


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return dict(_common(cfg), attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


def _mistral(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(_common(cfg), sliding_window=cfg.get("sliding_window", 4096))  # every layer, when set


def _qwen(cfg: dict[str, Any], bias: bool) -> dict[str, Any]:
    """Qwen2/Qwen3: sliding layers only with ``use_sliding_window``, from ``max_window_layers`` on."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    first = int(cfg.get("max_window_layers", 28))
    types = _layer_types(cfg, lambda i: "sliding_attention" if window and i >= first else "full_attention")
    return dict(_common(cfg), attention_bias=bias, sliding_window=window if window else None,
                layer_types=types if window else None)


def _qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    return _qwen(cfg, bias=True)


def _qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return dict(_qwen(cfg, bias), o_proj_bias=bias, qk_norm="head")


def _gemma(cfg: dict[str, Any], theta_default: float, pattern: int) -> dict[str, Any]:
    """Gemma 2 and 3: GeGLU, (1 + w) norms before and after each block, sqrt(hidden) embedding
    scale, query_pre_attn_scalar, sliding layers every ``pattern`` - 1 of ``pattern``."""
    hidden = int(cfg["hidden_size"])
    return dict(_common(cfg, theta_default), hidden_act=str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
                norm_layout="sandwich", norm_weight_offset=1.0, embedding_multiplier=hidden ** 0.5,
                attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                attention_bias=bool(cfg.get("attention_bias", False)),
                o_proj_bias=bool(cfg.get("attention_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                sliding_window=cfg.get("sliding_window"),
                layer_types=_layer_types(cfg, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention"),
                attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                final_logit_softcapping=cfg.get("final_logit_softcapping"))


def _gemma2(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _gemma(cfg, 10000.0, 2)
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (a causal LM only)")
    return out


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (a causal LM only)")
    out = _gemma(cfg, 1_000_000.0, int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6))
    local = _rope_params(cfg, "sliding_attention")
    theta, scaling = _rope(local, {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)} if local is None else {},
                           10000.0)
    return dict(out, qk_norm="head", sliding_rope_theta=theta, sliding_rope_scaling=scaling)


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    out = dict(_common(cfg, eps_default=1e-5), sliding_window=cfg.get("sliding_window"))  # every layer, when set
    if out["rope_scaling"] is not None and "original_max_position_embeddings" in cfg:
        out["rope_scaling"].setdefault("original_max_position_embeddings", int(cfg["original_max_position_embeddings"]))
    return out


def _smollm3(cfg: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3: Llama with every ``no_rope_layer_interval``-th layer without RoPE (``no_rope_layers``:
    1 = RoPE), sliding windows only with ``use_sliding_window``."""
    n = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("no_rope_layer_interval", 4))
    has_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = _layer_types(cfg, lambda i: "sliding_attention" if window and not has_rope[i] else "full_attention")
    return dict(_llama(cfg), nope_layers=tuple(i for i, r in enumerate(has_rope) if not r),
                sliding_window=window, layer_types=types if window else None)


def _ministral(cfg: dict[str, Any]) -> dict[str, Any]:
    """Ministral: Mistral with per-layer attention types."""
    window = cfg.get("sliding_window", 4096)
    types = _layer_types(cfg, lambda i: "sliding_attention" if window else "full_attention")
    return dict(_common(cfg), sliding_window=window, layer_types=types if window else None)


def _experts(cfg: dict[str, Any], norm_default: bool) -> dict[str, Any]:
    """The MoE fields shared by the Mixtral/Qwen-MoE configs: expert count, top k, which layers
    have experts (``mlp_only_layers`` and ``decoder_sparse_step``)."""
    n, e = int(cfg["num_hidden_layers"]), int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    dense, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step") or 1)
    layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=e, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", norm_default)),
                moe_layers=None if len(layers) == n else layers)


def _mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(_common(cfg, eps_default=1e-5), sliding_window=cfg.get("sliding_window"), **_experts(cfg, True))


def _qwen2_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(_qwen(cfg, bias=bool(cfg.get("qkv_bias", True))), **_experts(cfg, False),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


def _qwen3_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(_qwen3(cfg), **_experts(cfg, False))


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: attention sinks and biases, alternating sliding layers, experts routed by the top
    k logits then a softmax over them, clamped SwiGLU with biases (``engine/model/moe.py``)."""
    bias = bool(cfg.get("attention_bias", True))
    return dict(_common(cfg, eps_default=1e-5), attention_bias=bias, o_proj_bias=bias, attention_sinks=True,
                sliding_window=cfg.get("sliding_window", 128),
                layer_types=_layer_types(cfg, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention"),
                num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_router="topk_softmax", hidden_act="swiglu_oai",
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


def _olmo2(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return dict(_common(cfg, eps_default=1e-5), norm_layout="post", qk_norm="proj", attention_bias=bias,
                o_proj_bias=bias)


def _granite(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(_llama(cfg), embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                attention_scale=float(cfg.get("attention_multiplier", 1.0)),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)))


# Multimodal checkpoints whose language model runs alone (text in, text out): their config's
# ``text_config`` is read as this model_type, their tensors renamed by ``text_tensor_name``.
TEXT_MODELS = {"gemma3": "gemma3_text"}
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}


def text_tensor_name(model_type: str | None, name: str) -> str | None:
    """The HF name of checkpoint tensor ``name`` in the text model, None for a tensor the text
    model does not use (a multimodal checkpoint's vision tower and projector)."""
    if model_type not in TEXT_MODELS:
        return name
    for prefix, to in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language-model part (``TEXT_MODELS``), read as its text family."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json of model_type {cfg['model_type']!r} lacks text_config")
    out = {**text, "model_type": TEXT_MODELS[cfg["model_type"]]}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if out.get(key) is None and cfg.get(key) is not None:
            out[key] = cfg[key]
    return out


FAMILIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "gemma2": _gemma2,
    "gemma3_text": _gemma3, "phi3": _phi3, "olmo2": _olmo2, "granite": _granite, "smollm3": _smollm3,
    "ministral": _ministral, "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
}
SUPPORTED_HF_ARCHS = (*FAMILIES, *TEXT_MODELS)


def hf_config_to_model_config(cfg: dict[str, Any],
                              generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Translate a parsed ``config.json`` into :class:`ModelConfig` (``ValueError`` naming the key
    if it is missing, malformed or unsupported)."""
    model_type = cfg.get("model_type")
    if model_type in TEXT_MODELS:
        cfg, model_type = text_model_config(cfg), TEXT_MODELS[model_type]
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_HF_ARCHS)})")
    try:
        fields = FAMILIES[model_type](cfg)
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r} (model_type {model_type!r})") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"config.json has a malformed value (model_type {model_type!r}): {e}") from None
    fields["eos_token_id"] = _eos(cfg, generation_config)
    return ModelConfig(**fields)
