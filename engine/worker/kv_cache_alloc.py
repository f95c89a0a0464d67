"""KV-cache tensors from a memory budget.

One tensor per layer, ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (FlashInfer's
combined NHD layout; ``[:, 0]`` = K, ``[:, 1]`` = V). No backend reads a slot before a step has
written it (attention reads positions ``< kv_len`` only), so the CPU pool is allocated with
``torch.empty``: the OS hands out pages on first touch, and the pool costs resident memory only
as it fills (a 4 GiB pool adds nothing to RSS at start-up). CUDA pools are zeroed.

Budget (``EngineConfig.kv_cache_memory_bytes=None``, the default): :func:`default_kv_cache_bytes`.
"""

from __future__ import annotations

import torch

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.worker.host_memory import available_memory_bytes

CPU_KV_SHARE = 0.25          # of the memory available at start-up
CPU_KV_CAP = 4 << 30         # like vLLM-CPU's default KV space (VLLM_CPU_KVCACHE_SPACE=4 GiB)
CUDA_KV_SHARE = 0.5          # of the GPU memory free after the weights are loaded
FALLBACK_KV_BYTES = 512 << 20


def kv_cache_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (config.num_hidden_layers * 2 * block_size * config.num_key_value_heads
            * config.resolved_head_dim * elem)


def default_kv_cache_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                           max_num_seqs: int, max_model_len: int | None) -> int:
    """The KV pool when none is given: what ``max_num_seqs`` sequences of the full context need,
    capped by the machine. CPU: at most :data:`CPU_KV_SHARE` of the available memory and
    :data:`CPU_KV_CAP` (the pool is touched lazily, see the module doc); CUDA: at most
    :data:`CUDA_KV_SHARE` of the free GPU memory. At least one block."""
    per_block = kv_cache_block_bytes(config, block_size, dtype)
    context = max_model_len or config.max_position_embeddings
    need = max_num_seqs * -(-context // block_size) * per_block
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap = int(free * CUDA_KV_SHARE)
    else:
        avail = available_memory_bytes()
        cap = min(CPU_KV_CAP, int(avail * CPU_KV_SHARE)) if avail else FALLBACK_KV_BYTES
    return max(per_block, min(need, cap))


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
    alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros  # module doc
    return [alloc(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
