"""The model's own sampling defaults: what a request gets for the sampling fields it does not set.

vLLM's ``--generation-config auto`` (its default): the model creator's recommended sampling, from
the model files, replaces the engine's neutral defaults (temperature 1, no top-p/top-k) wherever a
request leaves a field unset. The fields are vLLM's: ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as ``max_tokens``.

* An HF directory: ``generation_config.json``, keeping only the values that differ from
  transformers' ``GenerationConfig`` defaults (vLLM reads ``GenerationConfig.to_diff_dict()``, so
  a file that writes ``"top_k": 50`` or ``"temperature": 1.0`` sets nothing). ``do_sample`` is
  ignored, as vLLM ignores it.
* A GGUF file: llama.cpp's ``general.sampling.*`` keys (``temp``, ``top_k``, ``top_p``,
  ``min_p``, ``penalty_repeat``; its converter writes them from that same file), read through the
  same filter, so a model's GGUF and its HF form get the same defaults.

A value ``SamplingParams`` refuses is a ``ValueError`` naming the file and the key, at start-up,
not a failure of every request later.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Any

# generation_config.json key -> SamplingParams field (vLLM's list)
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# llama.cpp's GGUF keys (gguf.Keys.General.SAMPLING_*) -> SamplingParams field
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
# transformers' GenerationConfig defaults: a value equal to one of these is not a recommendation
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                          "repetition_penalty": 1.0, "max_tokens": None}


def sampling_defaults(source: str) -> dict[str, Any]:
    """The sampling defaults of the model read from ``source`` (an HF directory or a ``.gguf``
    file) as ``SamplingParams`` fields; ``{}`` when it recommends none."""
    if os.path.isdir(source):
        path = os.path.join(source, "generation_config.json")
        if not os.path.isfile(path):
            return {}
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"{path}: not a JSON file ({exc})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: must hold a JSON object")
        return _checked(path, {_HF_KEYS[k]: (k, v) for k, v in values.items() if k in _HF_KEYS})
    if source.endswith(".gguf") and os.path.isfile(source):
        st = os.stat(source)
        return dict(_gguf_defaults(source, st.st_size, st.st_mtime_ns))
    return {}


@lru_cache(maxsize=8)
def _gguf_defaults(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    """Parsing a GGUF header takes ~60 ms (the default model): once per file version, not per engine."""
    from tokenbudget.engine.loader.gguf_file import read_gguf

    meta = read_gguf(path).metadata
    # float32 in the file: 0.6 reads back as 0.6000000238...; its shortest float32 spelling is 0.6
    return _checked(path, {_GGUF_KEYS[k]: (k, float(f"{v:.7g}") if isinstance(v, float) else v)
                           for k, v in meta.items() if k in _GGUF_KEYS})


def _checked(path: str, found: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    from tokenbudget.api.sampling_params import SamplingParams

    out = {field: value for field, (_, value) in found.items()
           if value is not None and value != _TRANSFORMERS_DEFAULTS[field]}
    for field, value in out.items():
        try:
            SamplingParams(**{field: value})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: {found[field][0]}: {exc}") from None
    return out


def describe(defaults: dict[str, Any]) -> str:
    """``temperature=0.6, top_p=0.95`` (the start-up line)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
