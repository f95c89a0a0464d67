"""Which ``quantization`` a model file asks for when the option is ``auto``.

A GGUF keeps its weights quantized; ``auto`` keeps them at the file's width: 4-bit types
(Q4_0, Q4_1, Q4_K, IQ4_*) -> ``int4``, 5- to 8-bit types -> ``int8``, float types -> ``none``,
decided by the type most of the block weights (``blk.*``, 2-D) have. HF checkpoints, CUDA and
non-fp32 dtypes -> ``none`` (the quantized kernels are CPU fp32-path only).
"""

from __future__ import annotations

from collections import Counter

import torch

_INT4 = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")
_INT8 = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_K")


def block_weight_type(tensors) -> str | None:
    """The GGUF type name most 2-D block weights (``blk.*``) of ``tensors`` (``GGUFTensor`` s)
    have, e.g. ``"Q4_1"``; None when there are none."""
    kinds = Counter(t.tensor_type.name for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    return kinds.most_common(1)[0][0] if kinds else None


def gguf_weight_quantization(path: str) -> str:
    from tokenbudget.engine.loader.gguf_file import read_gguf

    return quantization_for_type(block_weight_type(read_gguf(path).tensors))


def quantization_for_type(kind: str | None) -> str:
    return "int4" if kind in _INT4 else "int8" if kind in _INT8 else "none"


def resolve_quantization(quantization: str, source: str, dtype: torch.dtype, device: torch.device,
                         weight_type: str | None = None) -> str:
    """``auto`` -> what ``source`` holds (see module doc; ``weight_type``: the file's block-weight
    type when the loader already read it, else the file is read again); any other value is
    returned as is."""
    if quantization != "auto":
        return quantization
    if device.type != "cpu" or dtype != torch.float32 or not source.endswith(".gguf"):
        return "none"
    return quantization_for_type(weight_type) if weight_type else gguf_weight_quantization(source)
