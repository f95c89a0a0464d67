"""The pool of KV blocks: free queue, reference counts and prefix-cache hashes.

A block is *free* when no request references it (``ref_cnt == 0``); free blocks sit in one
queue ordered for eviction (least recently freed first). A free block may still carry a
prefix-cache hash: it can be hit again, and taken back out of the free queue, until the pool
hands it out as a new block, at which point its hash is dropped (eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Chained hash of the block's committed tokens; None while the block is not cacheable.
    block_hash: int | None = None


class BlockPool:
    """Owns every block. Invariant: ``ref_cnt == 0`` <=> the block is in ``free_queue``."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (front = evicted first).
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting their hashes."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        popitem = self.free_queue.popitem
        out = []
        for _ in range(n):
            _, block = popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def touch(self, blocks: list[KVBlock]) -> None:
        """Add a reference to each block (a prefix-cache hit), taking free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks) -> None:
        """Drop one reference from each block; blocks reaching zero join the back of the queue.

        Callers pass a request's blocks tail first, so that a request's last blocks (least
        likely to be shared) are evicted before its first ones.
        """
        queue = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed more often than referenced"
            if block.ref_cnt == 0:
                queue[block.block_id] = block

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        """Register a full block of committed tokens under its hash (first writer wins)."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # the same content already lives in another block; keep that one
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; only possible when no block is in use."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_integrity(self) -> None:
        for block in self.blocks:
            in_queue = block.block_id in self.free_queue
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free_queue={in_queue}")
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id} hash not indexed"
        for h, block in self.cached.items():
            assert block.block_hash == h, "cache index points at a block with another hash"
