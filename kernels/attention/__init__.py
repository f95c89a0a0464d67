"""Attention backends: interface (``base``), torch reference (``torch_ref``), selection."""

from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from kernels.attention.selector import select_attention_backend
from kernels.attention.torch_ref import TorchRefBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "TorchRefBackend",
           "select_attention_backend"]
