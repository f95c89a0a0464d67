"""Attention backends: interface (``base``), torch reference (``torch_ref``), selection."""

from tokenbudget.kernels.attention.base import (
           AttentionBackend,
           AttentionMetadata,
           AttentionSpec,
)
from tokenbudget.kernels.attention.selector import select_attention_backend
from tokenbudget.kernels.attention.torch_ref import TorchRefBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "TorchRefBackend",
           "select_attention_backend"]
