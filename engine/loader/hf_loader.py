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

from tokenbudget.engine.loader.model_checks import check_hf_model
from tokenbudget.engine.loader.model_dims import ModelDims
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["SUPPORTED_HF_ARCHS", "hf_config_to_model_config", "load_safetensors_dir", "load_hf_dir",
           "read_hf_configs", "safetensors_files"]

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


def safetensors_files(path: str) -> list[str]:
    """The safetensors files of ``path``: the index's shards when indexed, else every ``*.safetensors``.
    ValueError naming the index when it is malformed or names a file outside ``path``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = (_read_json(index) or {}).get("weight_map")
        names = set(weight_map.values()) if isinstance(weight_map, dict) else None
        if not names or not all(isinstance(n, str) and n == os.path.basename(n) and n not in (".", "..")
                                for n in names):
            raise ValueError(f"{index}: weight_map must map tensor names to file names in {path}")
        files = [os.path.join(path, name) for name in sorted(names)]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files (.bin checkpoints are not supported)")
    return files


def load_safetensors_dir(path: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in ``path`` (index-listed shards when indexed)."""
    state_dict: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        for name, tensor in load_file(file, device="cpu").items():
            state_dict[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state_dict


def _read_json(path: str) -> Any:
    """The parsed file, None when it does not exist; ValueError naming it when it is not JSON."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from None


def read_hf_configs(path: str) -> tuple[dict[str, Any], dict[str, Any] | None, ModelDims]:
    """``config.json`` and ``generation_config.json`` (None when absent) parsed, and the sizes,
    once both are checked against the safetensors headers (``model_checks.check_hf_model``)."""
    cfg = _read_json(os.path.join(path, "config.json"))
    if cfg is None:
        raise FileNotFoundError(f"{path} has no config.json")
    generation = _read_json(os.path.join(path, "generation_config.json"))
    return cfg, generation, check_hf_model(path, cfg, generation, safetensors_files(path))


def load_hf_dir(path: str, dtype: torch.dtype = torch.float32
                ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read an HF directory; returns ``(config, state_dict, tokenizer)``."""
    cfg, generation, _ = read_hf_configs(path)  # checked against the tensor shapes, from headers
    config = hf_config_to_model_config(cfg, generation)
    state_dict = load_safetensors_dir(path, dtype)
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in state_dict and not config.tie_word_embeddings:
        import msgspec

        config = msgspec.structs.replace(config, tie_word_embeddings=True)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return config, state_dict, Tokenizer.from_pretrained_dir(path)
