"""The pool of KV blocks: free queue, reference counts and prefix-cache hashes.

A block is *free* when no request references it (``ref_cnt == 0``); free blocks sit in one
queue ordered for eviction (least recently freed first, ``kv_cache.free_queue``). A free block may
still carry a prefix-cache hash: it can be hit again, and taken back out of the free queue, until
the pool hands it out as a new block, at which point its hash is dropped (eviction).

While ``journal`` is set (an ``UndoLog``, during a step's scheduling) every change records its
inverse there; see ``kv_cache.journal`` for what a rollback after a forward pass keeps.

While ``events`` is set (a ``KVEventLog``, ``kv_cache.events``) every hash the pool gains or loses
is staged there; the scheduler publishes them at a step's commit.
"""

from __future__ import annotations

from tokenbudget.kv_cache.block import KVBlock
from tokenbudget.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from tokenbudget.kv_cache.free_queue import FreeBlockQueue
from tokenbudget.kv_cache.journal import UndoLog


class BlockPool:
    """Owns every block. Invariant: ``ref_cnt == 0`` <=> the block is in ``free_queue``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks, KVBlock)
        self.cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        self.journal: UndoLog | None = None
        self.events: KVEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting their hashes."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        popleft = self.free_queue.popleft
        out, evicted = [], []
        for _ in range(n):
            block = popleft()
            block_hash = block.block_hash
            if block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
            evicted.append(block_hash)
        if self.journal is not None:
            self.journal.record(self._undo_new, out, evicted)
        return out

    def _undo_new(self, dirty: bool, blocks: list[KVBlock], evicted: list[int | None]) -> None:
        restore_front, cached = self.free_queue.restore_front, self.cached
        for block, block_hash in zip(reversed(blocks), reversed(evicted)):
            block.ref_cnt = 0
            restore_front(block)
            if block_hash is None:
                continue
            if not dirty and block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block
                self.num_evictions -= 1
            elif self.events is not None and self._was_indexed(block_hash):
                self.events.stage(BlockRemoved(block_hash))  # lost for good: the rollback cannot give it back

    def _evict(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.stage(BlockRemoved(block.block_hash))
        block.block_hash = None
        self.num_evictions += 1

    def _was_indexed(self, block_hash: int) -> bool:
        """Whether subscribers hold ``block_hash`` (published and not removed since): a hash a
        rolled-back step evicted that no other block took meanwhile."""
        return block_hash in self.events.live and block_hash not in self.cached

    def touch(self, blocks: list[KVBlock]) -> None:
        """Add a reference to each block (a prefix-cache hit), taking free ones out of the queue."""
        journal = self.journal
        for block in blocks:
            prev = self.free_queue.remove(block) if block.ref_cnt == 0 else None
            block.ref_cnt += 1
            if journal is not None:
                journal.record(self._undo_touch, block, prev)

    def _undo_touch(self, dirty: bool, block: KVBlock, prev: KVBlock | None) -> None:
        block.ref_cnt -= 1
        if prev is not None:
            self.free_queue.restore_after(block, prev)

    def free_blocks(self, blocks) -> None:
        """Drop one reference from each block; blocks reaching zero join the back of the queue.

        Callers pass a request's blocks tail first, so that a request's last blocks (least
        likely to be shared) are evicted before its first ones.
        """
        append, journal = self.free_queue.append, self.journal
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed more often than referenced"
            if block.ref_cnt == 0:
                append(block)
            if journal is not None:
                journal.record(self._undo_free, block)

    def _undo_free(self, dirty: bool, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            self.free_queue.unlink_back(block)
        block.ref_cnt += 1

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: int, parent_hash: int | None = None,
                    token_ids: tuple[int, ...] = ()) -> None:
        """Register a full block of committed tokens under its hash (first writer wins);
        ``parent_hash`` (None for a first block) and ``token_ids`` describe it to ``events``."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # the same content already lives in another block; keep that one
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stage(BlockStored(block_hash, parent_hash, token_ids, len(token_ids)))

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; only possible when no block is in use."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.stage(AllBlocksCleared())
            self.events.publish()  # between steps: nothing can roll it back
        return True

    def check_integrity(self) -> None:
        queue = self.free_queue
        assert len(set(queue)) == len(queue), "a block is in the free queue twice"
        for block in self.blocks:
            in_queue = block.block_id in queue
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free_queue={in_queue}")
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id} hash not indexed"
        for h, block in self.cached.items():
            assert block.block_hash == h, "cache index points at a block with another hash"
