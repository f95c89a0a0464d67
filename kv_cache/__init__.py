"""Paged KV-cache bookkeeping: a block pool with prefix caching and a per-request manager."""

from kv_cache.block_pool import BlockPool, KVBlock
from kv_cache.manager import KVCacheManager, KVCacheUsage

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "KVCacheUsage"]
