"""Model loading: one entry point for HF directories, GGUF files and the default model.

``load_model_files(model, dtype)`` returns a :class:`LoadedModel`: a :class:`ModelConfig`, a state
dict with Hugging Face parameter names and layout (dequantized to ``dtype``), the
:class:`Tokenizer`, and ``source`` (the resolved path that was read). ``model=None`` means the
default model (SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into a cache; see
``engine.loader.default_model``); a Hugging Face Hub id (``org/name``, ``org/name:Q8_0``,
``org/name/file.gguf``) is fetched through huggingface_hub (``engine.loader.hub``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokenbudget.engine.loader.default_model import default_model_path
from tokenbudget.engine.loader.hub import resolve_model_path
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["LoadedModel", "load_model_files", "default_model_path"]


@dataclass(slots=True)
class LoadedModel:
    """What a model file yields. ``state_dict`` keys are HF names; tensors are CPU ``dtype``."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    weight_type: str | None = None  # GGUF: the type most block weights have ("Q4_1"); HF: None


def load_model_files(model: str | os.PathLike[str] | None,
                     dtype: torch.dtype = torch.float32, revision: str | None = None) -> LoadedModel:
    """Load a model from an HF directory, a ``.gguf`` file, a hub id (at ``revision``), or the
    default model (``None``).

    Raises ``FileNotFoundError`` when ``model`` does not exist, ``ValueError`` /
    ``NotImplementedError`` for unsupported content, ``RuntimeError`` when the default model
    cannot be fetched.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    path = default_model_path() if model is None else resolve_model_path(os.fspath(model), revision)
    if os.path.isdir(path):
        from tokenbudget.engine.loader.hf_loader import load_hf_dir

        config, state_dict, tokenizer = load_hf_dir(path, dtype)
        weight_type = None
    elif os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file; pass a .gguf file or an HF directory")
        from tokenbudget.engine.loader.gguf_loader import load_gguf

        config, state_dict, tokenizer, weight_type = load_gguf(path, dtype)
    else:
        raise FileNotFoundError(
            f"model {path!r} not found: pass a .gguf file, a Hugging Face directory "
            "(config.json + *.safetensors + tokenizer.json) or a Hugging Face Hub id (org/name)")
    return LoadedModel(config=config, state_dict=state_dict, tokenizer=tokenizer, source=path,
                       weight_type=weight_type)
