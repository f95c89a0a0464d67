"""KV-cache tensors from a memory budget.

One tensor per layer, ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (FlashInfer's
combined NHD layout; ``[:, 0]`` = K, ``[:, 1]`` = V). Allocated zeroed: the torch reference
backend reads whole pages, and stale-but-finite values times an exact-zero softmax weight stay 0.
"""

from __future__ import annotations

import torch

from tokenbudget.engine.model.config import ModelConfig


def kv_cache_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (config.num_hidden_layers * 2 * block_size * config.num_key_value_heads
            * config.resolved_head_dim * elem)


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype,
                          memory_bytes: int) -> int:
    """How many blocks fit in ``memory_bytes``; ValueError when not even one does."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    per_block = kv_cache_block_bytes(config, block_size, dtype)
    n = int(memory_bytes) // per_block
    if n < 1:
        raise ValueError(f"memory_bytes={memory_bytes} cannot hold one KV block "
                         f"({per_block} bytes for block_size={block_size}, dtype={dtype})")
    return n


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
    shape = (num_blocks, 2, block_size, config.num_key_value_heads, config.resolved_head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
