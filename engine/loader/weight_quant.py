"""Which ``quantization`` a model file asks for when the option is ``auto``.

A GGUF keeps its weights quantized; ``auto`` keeps them at the file's width: 4-bit types
(Q4_0, Q4_1, Q4_K, IQ4_*) -> ``int4``, 5- to 8-bit types -> ``int8``, float types -> ``none``,
decided by the type most of the block weights (``blk.*``, 2-D) have. HF checkpoints, CUDA and
non-fp32 dtypes -> ``none`` (the quantized kernels are CPU fp32-path only).
"""

from __future__ import annotations

import os
from collections import Counter

import torch

_INT4 = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")
_INT8 = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_K")


def gguf_weight_quantization(path: str) -> str:
    from gguf import GGUFReader

    reader = GGUFReader(os.fspath(path), "r")
    kinds = Counter(t.tensor_type.name for t in reader.tensors
                    if t.name.startswith("blk.") and len(t.shape) == 2)
    if not kinds:
        return "none"
    kind = kinds.most_common(1)[0][0]
    return "int4" if kind in _INT4 else "int8" if kind in _INT8 else "none"


def resolve_quantization(quantization: str, source: str, dtype: torch.dtype, device: torch.device) -> str:
    """``auto`` -> what ``source`` holds (see module doc); any other value is returned as is."""
    if quantization != "auto":
        return quantization
    if device.type != "cpu" or dtype != torch.float32 or not source.endswith(".gguf"):
        return "none"
    return gguf_weight_quantization(source)
