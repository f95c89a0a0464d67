"""Paged KV-cache bookkeeping: a block pool with prefix caching and a per-request manager."""

if __name__ != "tokenbudget.kv_cache":  # a second copy of every module would be loaded
    raise ImportError("this folder installs as tokenbudget.kv_cache: `import tokenbudget` instead")

from tokenbudget.kv_cache.block import KVBlock
from tokenbudget.kv_cache.block_pool import BlockPool
from tokenbudget.kv_cache.manager import KVCacheManager, KVCacheUsage

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "KVCacheUsage"]
