"""Load a Hugging Face model directory: ``config.json`` + ``*.safetensors`` (+ index) + tokenizer.

Config: both transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``)
spellings are read. ``rope_scaling`` is normalised to a dict that always carries ``rope_type``
(copied from the old ``type`` key; ``rope_theta`` removed), or ``None`` for plain RoPE.
Mistral's ``sliding_window`` is not represented in :class:`ModelConfig` and is ignored (exact
for prompts shorter than the window). ``eos_token_id`` may be a list; ``generation_config.json``'s
EOS ids are merged in, as transformers' ``generate`` does.

Weights: every tensor from the (possibly sharded) safetensors files, converted to ``dtype``;
keys are HF names. ``lm_head.weight`` is dropped when ``tie_word_embeddings`` is set and is
absent; the config is marked tied when the checkpoint has no ``lm_head.weight``.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from safetensors.torch import load_file

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["SUPPORTED_HF_ARCHS", "hf_config_to_model_config", "load_safetensors_dir", "load_hf_dir"]

SUPPORTED_HF_ARCHS = ("llama", "mistral", "qwen2")


def _normalise_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, dict) else dict(cfg.get("rope_scaling") or {})
    theta = float(scaling.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if not scaling or scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def hf_config_to_model_config(cfg: dict[str, Any],
                              generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Translate a parsed ``config.json`` into :class:`ModelConfig` (``ValueError`` if unsupported)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_HF_ARCHS:
        raise ValueError(f"model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_HF_ARCHS)})")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    theta, scaling = _normalise_rope(cfg)
    eos: Any = cfg.get("eos_token_id")
    gen_eos = (generation_config or {}).get("eos_token_id")
    if gen_eos is not None:
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        ids = list(dict.fromkeys(ids))
        eos = ids[0] if len(ids) == 1 else ids
    heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
    )


def load_safetensors_dir(path: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in ``path`` (index-listed shards when indexed)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files (.bin checkpoints are not supported)")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file, device="cpu").items():
            state_dict[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state_dict


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_hf_dir(path: str, dtype: torch.dtype = torch.float32
                ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read an HF directory; returns ``(config, state_dict, tokenizer)``."""
    cfg = _read_json(os.path.join(path, "config.json"))
    if cfg is None:
        raise FileNotFoundError(f"{path} has no config.json")
    config = hf_config_to_model_config(cfg, _read_json(os.path.join(path, "generation_config.json")))
    state_dict = load_safetensors_dir(path, dtype)
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in state_dict and not config.tie_word_embeddings:
        import msgspec

        config = msgspec.structs.replace(config, tie_word_embeddings=True)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return config, state_dict, Tokenizer.from_pretrained_dir(path)
