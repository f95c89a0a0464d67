"""Model loading: one entry point for HF directories, GGUF files and the default model.

``load_model_files(model, dtype)`` returns a :class:`LoadedModel`: a :class:`ModelConfig`, a state
dict with Hugging Face parameter names and layout (dequantized to ``dtype``), the
:class:`Tokenizer`, and ``source`` (the resolved path that was read). ``check_model_files(model)``
runs only the header checks it starts with (``engine.loader.model_checks``). Every problem with
the file's content is a ``ValueError`` whose message starts with the file's path. ``model=None`` means the
default model (SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into a cache; see
``engine.loader.default_model``); a Hugging Face Hub id (``org/name``, ``org/name:Q8_0``,
``org/name/file.gguf``) is fetched through huggingface_hub (``engine.loader.hub``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from tokenbudget.engine.loader.default_model import default_model_path
from tokenbudget.engine.loader.hub import resolve_model_path
from tokenbudget.engine.loader.model_dims import ModelDims
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["LoadedModel", "load_model_files", "check_model_files", "default_model_path"]

_T = TypeVar("_T")


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

    Raises ``FileNotFoundError`` when ``model`` does not exist, ``ValueError`` naming the file
    for malformed, inconsistent or unsupported content (the checks of
    :func:`check_model_files` run first, on headers, before any weight is read),
    ``RuntimeError`` when the default model cannot be fetched.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    path = _resolve(model, revision)
    return _naming_the_file(path, _load, path, dtype)


def check_model_files(model: str | os.PathLike[str] | None, revision: str | None = None) -> ModelDims:
    """The checks ``load_model_files`` starts with, alone: the file's metadata (``config.json``)
    values and its tensor shapes, from headers (milliseconds; no weight is read; see
    ``engine.loader.model_checks``). Returns the model's sizes; raises as ``load_model_files``."""
    path = _resolve(model, revision)
    return _naming_the_file(path, _check, path)


def _resolve(model: str | os.PathLike[str] | None, revision: str | None) -> str:
    path = default_model_path() if model is None else resolve_model_path(os.fspath(model), revision)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model {path!r} not found: pass a .gguf file, a Hugging Face directory "
            "(config.json + *.safetensors + tokenizer.json) or a Hugging Face Hub id (org/name)")
    if not os.path.isdir(path) and not path.endswith(".gguf"):
        raise ValueError(f"{path}: not a .gguf file; pass a .gguf file or an HF directory")
    return path


def _naming_the_file(path: str, fn: Callable[..., _T], *args) -> _T:
    """``fn(*args)``, with a ValueError or NotImplementedError turned into a ValueError whose
    message starts with ``path``: one error type, naming the file, for whatever is wrong in it."""
    try:
        return fn(*args)
    except (ValueError, NotImplementedError) as exc:
        if isinstance(exc, ValueError) and str(exc).startswith(path):
            raise
        raise ValueError(f"{path}: {exc}") from exc


def _check(path: str) -> ModelDims:
    if os.path.isdir(path):
        from tokenbudget.engine.loader.hf_loader import read_hf_configs

        return read_hf_configs(path)[2]
    from tokenbudget.engine.loader.gguf_file import read_gguf
    from tokenbudget.engine.loader.model_checks import check_gguf_model

    return check_gguf_model(read_gguf(path))


def _load(path: str, dtype: torch.dtype) -> LoadedModel:
    if os.path.isdir(path):
        from tokenbudget.engine.loader.hf_loader import load_hf_dir

        config, state_dict, tokenizer = load_hf_dir(path, dtype)
        weight_type = None
    else:
        from tokenbudget.engine.loader.gguf_loader import load_gguf

        config, state_dict, tokenizer, weight_type = load_gguf(path, dtype)
    return LoadedModel(config=config, state_dict=state_dict, tokenizer=tokenizer, source=path,
                       weight_type=weight_type)
