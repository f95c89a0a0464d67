"""Load a Hugging Face model directory: ``config.json`` + ``*.safetensors`` (+ index) + tokenizer.

Config: ``engine/loader/hf_config.py`` (one reader per family). ``eos_token_id`` may be a list;
``generation_config.json``'s EOS ids are merged in, as transformers' ``generate`` does.

Weights: every tensor from the (possibly sharded) safetensors files, converted to ``dtype``;
keys are HF names. ``lm_head.weight`` is dropped when ``tie_word_embeddings`` is set and is
absent; the config is marked tied when the checkpoint has no ``lm_head.weight``.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from typing import Any

import torch
from safetensors import safe_open

from tokenbudget.engine.loader.hf_config import hf_config_to_model_config, text_tensor_name
from tokenbudget.engine.loader.model_checks import check_hf_model
from tokenbudget.engine.loader.model_dims import ModelDims
from tokenbudget.engine.loader.mxfp4 import dequantize_state_dict
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["load_safetensors_dir", "load_hf_dir", "read_hf_configs", "safetensors_files"]


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


def load_safetensors_dir(path: str, dtype: torch.dtype = torch.float32,
                        rename=None) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in ``path`` (index-listed shards when indexed);
    ``rename(name)``: the name to keep a tensor under, or None to skip it unread."""
    state_dict: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                keep = name if rename is None else rename(name)
                if keep is not None:
                    tensor = f.get_tensor(name)
                    state_dict[keep] = tensor.to(dtype) if tensor.is_floating_point() else tensor
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
    state_dict = load_safetensors_dir(path, dtype, rename=functools.partial(text_tensor_name, cfg.get("model_type")))
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    dequantize_state_dict(state_dict, dtype)  # gpt-oss's MXFP4 experts
    if "lm_head.weight" not in state_dict and not config.tie_word_embeddings:
        import msgspec

        config = msgspec.structs.replace(config, tie_word_embeddings=True)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return config, state_dict, Tokenizer.from_pretrained_dir(path)
