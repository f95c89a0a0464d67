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
from tokenbudget.engine.loader.mxfp4 import dequantize_state_dict
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["load_safetensors_dir", "load_hf_dir"]

def load_safetensors_dir(path: str, dtype: torch.dtype = torch.float32,
                        rename=None) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in ``path`` (index-listed shards when indexed);
    ``rename(name)``: the name to keep a tensor under, or None to skip it unread."""
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
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                keep = name if rename is None else rename(name)
                if keep is not None:
                    tensor = f.get_tensor(name)
                    state_dict[keep] = tensor.to(dtype) if tensor.is_floating_point() else tensor
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
    state_dict = load_safetensors_dir(path, dtype, rename=functools.partial(text_tensor_name, cfg.get("model_type")))
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    dequantize_state_dict(state_dict, dtype)  # gpt-oss's MXFP4 experts
    if "lm_head.weight" not in state_dict and not config.tie_word_embeddings:
        import msgspec

        config = msgspec.structs.replace(config, tie_word_embeddings=True)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return config, state_dict, Tokenizer.from_pretrained_dir(path)
