"""The free-block queue: a doubly linked list threaded through the blocks themselves.

Order is eviction order: the pool takes new blocks from the front and a block whose last
reference is dropped joins the back, so the least recently freed block is evicted first. A
prefix-cache hit takes a free block out of the middle. Every operation is O(1), and each has an
exact inverse (``restore_front``, ``restore_after``, ``unlink_back``), which is what lets a failed
step put the queue back exactly as it was: undone in reverse order (LIFO), the neighbours a block
had when it left are its neighbours again when it returns.

Iterating yields block ids front to back; ``block_id in queue`` asks whether a block is free.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenbudget.kv_cache.block import KVBlock


class FreeBlockQueue:
    __slots__ = ("_head", "_tail", "_len", "_by_id")

    def __init__(self, blocks: list[KVBlock], sentinel_factory) -> None:
        self._head = sentinel_factory(-1)
        self._tail = sentinel_factory(-2)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._by_id = {b.block_id: b for b in blocks}
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        node = self._head.next_free
        while node is not self._tail:
            yield node.block_id
            node = node.next_free

    def __contains__(self, block_id: int) -> bool:
        block = self._by_id.get(block_id)
        return block is not None and block.prev_free is not None

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        self._unlink(block)
        return block

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail.prev_free)

    def remove(self, block: KVBlock) -> KVBlock:
        """Take ``block`` out of the middle; returns the block that preceded it (for undo)."""
        prev = block.prev_free
        self._unlink(block)
        return prev

    # ---- exact inverses, for undo in reverse order
    def restore_front(self, block: KVBlock) -> None:
        """Inverse of ``popleft``."""
        self._link(block, self._head)

    def restore_after(self, block: KVBlock, prev: KVBlock) -> None:
        """Inverse of ``remove`` (``prev`` is what ``remove`` returned)."""
        self._link(block, prev)

    def unlink_back(self, block: KVBlock) -> None:
        """Inverse of ``append``."""
        assert self._tail.prev_free is block, "undo out of order: block is not at the back"
        self._unlink(block)

    # ---- links
    def _link(self, block: KVBlock, prev: KVBlock) -> None:
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self._len += 1

    def _unlink(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1
