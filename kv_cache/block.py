"""``KVBlock``: one block of the paged KV cache as the pool sees it.

Its own module because both the pool (``block_pool``) and the free queue threaded through the
blocks (``free_queue``) name it, and neither may import the other's module back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Chained hash of the block's committed tokens; None while the block is not cacheable.
    block_hash: int | None = None
    # Links of the free queue (both None while the block is referenced).
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"
