"""A model file checked against itself before anything large is built from it.

The loaders call these first, on headers only (no tensor is dequantized or read):

- :func:`check_gguf_model`: a parsed GGUF's metadata values (``model_dims``: types, bounds) and
  its tensors' shapes against them (``tensor_layouts``): ``embedding_length`` against
  ``token_embd``'s width, ``block_count`` against the ``blk.N`` layers present, head counts and
  ``key_length`` against the projections' rows, ``feed_forward_length`` against the MLP, the
  token list against the embedding's rows.
- :func:`check_hf_model`: ``config.json``'s values and the shapes in the safetensors headers
  (``safe_open(...).get_slice(name).get_shape()``) against the model's own table of the tensors it
  reads (``engine.model.weights.check_state_dict``: missing, leftover or misshapen tensors); an
  unreadable or corrupt safetensors file is refused naming it.

Each returns the file's :class:`ModelDims`; every failure is a ``ValueError`` naming the file, the
key and both numbers. A file is untrusted: these checks are what stands between a metadata
value of ``2**40`` and an allocation of that size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from safetensors import SafetensorError, safe_open

from tokenbudget.engine.loader.gguf_file import GGUFFile
from tokenbudget.engine.loader.hf_config import (
    TEXT_MODELS,
    hf_config_to_model_config,
    text_model_config,
    text_tensor_name,
)
from tokenbudget.engine.loader.model_dims import ModelDims, gguf_model_dims, hf_model_dims
from tokenbudget.engine.loader.mxfp4 import mxfp4_shapes
from tokenbudget.engine.loader.tensor_layouts import (
    GGUF_LAYER_RE,
    GGUF_LAYOUTS,
    HF_LAYER_RE,
    check_layers,
    check_tensor_shapes,
    layer_indices,
    layout_for,
)
from tokenbudget.engine.model.weights import check_state_dict

__all__ = ["check_gguf_model", "check_hf_model", "safetensors_shapes"]

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def check_gguf_model(gguf: GGUFFile) -> ModelDims:
    """Check a parsed GGUF's metadata and tensor shapes (module doc); its sizes."""
    shapes = {t.name: tuple(reversed(t.shape)) for t in gguf.tensors}  # HF order: rows first
    embd = shapes.get("token_embd.weight")
    dims = gguf_model_dims(gguf.metadata, embd[0] if embd is not None and len(embd) == 2 else None, gguf.path)
    layout = layout_for(GGUF_LAYOUTS, gguf.metadata["general.architecture"])
    check_tensor_shapes(shapes, dims, layout, GGUF_LAYER_RE, gguf.path)
    return dims


def check_hf_model(path: str, cfg: Any, generation: Any, files: list[str]) -> ModelDims:
    """Check an HF directory's parsed ``config.json`` (and ``generation_config.json``, None when
    absent) and the safetensors ``files``' headers. A multimodal checkpoint (``TEXT_MODELS``) is
    checked as its language model: its text config, its tensors under their text-model names."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: config.json must hold a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if type(model_type) is not str:
        raise ValueError(f"{path}: model_type must be a string, got {model_type!r:.40}")
    text = text_model_config(cfg) if model_type in TEXT_MODELS else cfg
    dims = hf_model_dims(text, path, generation)
    shapes = mxfp4_shapes(safetensors_shapes(files, functools.partial(text_tensor_name, model_type)))
    check_layers(layer_indices(shapes, HF_LAYER_RE), dims, path)  # before any per-layer table is built
    try:  # the model's own table of what it reads (engine/model/weights.py): one rule, used twice
        check_state_dict(hf_config_to_model_config(cfg, generation), shapes)
    except ValueError as e:
        dims_read = (dims.hidden, dims.heads, dims.kv_heads, dims.head_dim, dims.ffn, dims.vocab)
        sizes = "; ".join(d.source for d in dims_read)
        raise ValueError(f"{path}: {e} ({sizes})") from None
    return dims


def safetensors_shapes(files: list[str], rename: Callable[[str], str | None] = lambda name: name
                       ) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over ``files``, read from their headers alone; ``rename`` as
    ``hf_loader.load_safetensors_dir``'s (None: a tensor the model does not read). ValueError
    naming the file when one is unreadable or corrupt, holds a weight or bias that is not
    floating point, or repeats another file's tensor."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():
                    name = rename(stored)
                    if name is None:
                        continue
                    part = f.get_slice(stored)
                    if name in shapes:
                        raise ValueError(f"{file}: tensor {name!r} is also in another safetensors file")
                    if name.endswith((".weight", ".bias")) and part.get_dtype() not in _FLOAT_DTYPES:
                        raise ValueError(f"{file}: tensor {name!r} has dtype {part.get_dtype()}; weights are "
                                         f"floating point ({', '.join(_FLOAT_DTYPES)})")
                    shapes[name] = tuple(part.get_shape())
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None
    return shapes
