"""KV-cache manager: block tables of requests over one ``BlockPool``.

The manager knows a request only through ``request_id``, ``all_token_ids`` (committed tokens)
and ``num_computed_tokens``. What it guarantees:

* ``allocate_slots`` reserves every block a step needs, or returns None and changes nothing.
* ``rewind`` returns blocks that hold only positions past the computed tokens (rejected drafts,
  an unused lookahead), so after a verify a request holds exactly what its KV needs.
* Only full blocks of computed, committed tokens are ever hashed: a hashed block never holds a
  draft, and a prefix-cache hit never covers a request's last token (it is always recomputed,
  because the step needs its logits).

One record per request (``RequestBlocks``, in the ``requests`` table, ``tokenbudget.request_table``):
its blocks, their ids (the block table handed to the step contract), how many are in the prefix
cache and the block hashes of its committed prefix. Unlike the tables above the scheduler, these
records change in place: the scheduler's hot loop asks for every running request's blocks every
step, and a block boundary crossed (every few steps per request with drafts) would otherwise be a
new record and two new lists. So while ``journal`` is set (``set_journal``, during a step's
scheduling) every change records its inverse in the step's ``UndoLog``, as the pool's changes do
(``kv_cache.journal``): the scheduler's journal, which also keeps a preemption a rollback after a
forward pass must not undo.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenbudget.kv_cache.block import KVBlock
from tokenbudget.kv_cache.block_pool import BlockPool
from tokenbudget.kv_cache.hashing import extend_block_hashes
from tokenbudget.kv_cache.journal import UndoLog
from tokenbudget.request_table import RequestTable


@dataclass(slots=True)
class KVCacheUsage:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float  # fraction of blocks referenced by some request
    prefix_cache_queries: int
    prefix_cache_hits: int


@dataclass(slots=True)
class RequestBlocks:
    """One request's blocks (changed in place, journaled in the step's ``UndoLog``: module doc)."""

    blocks: list[KVBlock] = field(default_factory=list)  # held, in position order; empty: not allocated
    block_ids: list[int] = field(default_factory=list)   # their ids: the block table of the step contract
    num_cached: int = 0                                  # leading blocks registered in the prefix cache
    hashes: list[int] = field(default_factory=list)      # chained hashes of the committed prefix's full
    #                                                      blocks computed so far (a cache of the tokens)


_NONE = RequestBlocks()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.requests: RequestTable[RequestBlocks] = RequestTable("kv blocks")
        self.prefix_queries = 0  # prompt tokens of admitted requests
        self.prefix_hits = 0  # of those, tokens served from the cache
        self.journal: UndoLog | None = None

    def set_journal(self, journal: UndoLog | None) -> None:
        self.journal = self.pool.journal = journal

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: read it, do not mutate it)."""
        return self.requests.get(request_id, _NONE).block_ids

    def usage(self) -> KVCacheUsage:
        pool = self.pool
        used = pool.num_blocks - pool.num_free_blocks
        return KVCacheUsage(pool.num_blocks, pool.num_free_blocks, len(pool.cached),
                            used / pool.num_blocks, self.prefix_queries, self.prefix_hits)

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request's committed tokens.

        Never the whole sequence: at most ``(num_tokens - 1) // block_size`` blocks, so the last
        token is always recomputed. Takes no reference and counts nothing: ``allocate_slots``
        takes the references, ``record_prefix_lookup`` counts an admission that happened. A
        request marked ``skip_reading_prefix_cache`` (it needs every prompt position's logits)
        gets none; its blocks are still cached for others.
        """
        if not self.looks_up(request):
            return [], 0
        tokens = request.all_token_ids
        rec = self.requests.get(request.request_id)
        if rec is None:  # a cache of the tokens, kept (with no blocks) until the request is freed
            rec = RequestBlocks()
            self.requests.set(request.request_id, rec)
        hashes = rec.hashes
        max_blocks = (len(tokens) - 1) // self.block_size
        extend_block_hashes(hashes, tokens, self.block_size, max_blocks)
        hits: list[KVBlock] = []
        lookup = self.pool.lookup
        for h in hashes[:max_blocks]:
            block = lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def looks_up(self, request) -> bool:
        """Whether admitting ``request`` looks the prefix cache up (caching on, and the request
        does not need every prompt position computed); only such lookups are counted."""
        return self.enable_prefix_caching and not getattr(request, "skip_reading_prefix_cache", False)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (hit rate = hits / queries); call it only when
        ``looks_up(request)``: a request that looked nothing up is no query."""
        if self.journal is not None:
            self.journal.record(self._undo_counters, self.prefix_queries, self.prefix_hits)
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def _undo_counters(self, dirty: bool, queries: int, hits: int) -> None:
        self.prefix_queries, self.prefix_hits = queries, hits

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request, num_new_tokens: int, num_lookahead_tokens: int = 0,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[int] | None:
        """Reserve room for ``num_new_tokens`` more positions (plus a lookahead tail).

        ``new_computed_blocks`` are prefix-cache hits for a request being admitted (from
        ``get_computed_blocks``). Returns the request's whole block table, or None when the pool
        cannot serve the request; then nothing changed.
        """
        rid = request.request_id
        rec = self.requests.get(rid)
        held = rec.blocks if rec is not None else None
        if held and not new_computed_blocks:
            # Fast path (a running request's decode/verify step): same arithmetic as below.
            total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
            if num_lookahead_tokens:
                total = min(total + num_lookahead_tokens, max(total, self.max_model_len))
            if -(-total // self.block_size) <= len(held):
                return rec.block_ids
        num_held = len(held) if held else 0
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        total = min(total + num_lookahead_tokens, max(total, self.max_model_len))
        num_needed = -(-total // self.block_size) - num_held - num_hits
        if num_needed <= 0 and not num_hits and held:
            return rec.block_ids  # fast path: the step fits in the blocks held
        pool = self.pool
        # Hits sitting in the free queue are free blocks we are about to take back.
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if num_hits else 0
        if num_needed > pool.num_free_blocks - revived:
            return None
        if rec is None:
            rec = RequestBlocks()
            self.requests.set(rid, rec)
        if self.journal is not None:
            self.journal.record(self._undo_allocate, rec, num_held, rec.num_cached)
        held, ids = rec.blocks, rec.block_ids
        if num_hits:
            pool.touch(new_computed_blocks)
            held.extend(new_computed_blocks)
            ids.extend(b.block_id for b in new_computed_blocks)
            rec.num_cached = len(held)
        if num_needed > 0:
            new = pool.get_new_blocks(num_needed)
            held.extend(new)
            ids.extend(b.block_id for b in new)
        return ids

    @staticmethod
    def _undo_allocate(dirty: bool, rec: RequestBlocks, num_held: int, num_cached: int) -> None:
        """Table side of an allocation (the pool's own records give the blocks back); a record
        left without blocks keeps its hashes until the request is freed, like one that only looked up."""
        del rec.blocks[num_held:], rec.block_ids[num_held:]
        rec.num_cached = num_cached

    def rewind(self, request, num_lookahead_tokens: int = 0) -> int:
        """Free tail blocks beyond ``num_computed_tokens + num_lookahead_tokens``; returns how many."""
        rec = self.requests.get(request.request_id)
        held = rec.blocks if rec is not None else None
        if not held:
            return 0
        keep_tokens = min(request.num_computed_tokens + num_lookahead_tokens,
                          max(request.num_computed_tokens, self.max_model_len))
        keep = -(-keep_tokens // self.block_size)
        extra = len(held) - keep
        if extra <= 0:
            return 0
        tail = held[keep:]
        del held[keep:]
        del rec.block_ids[keep:]
        tail.reverse()
        self.pool.free_blocks(tail)
        return extra

    def cache_blocks(self, request) -> None:
        """Hash the request's full blocks of computed committed tokens (drafts excluded)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens
        num_committed = len(request.all_token_ids)
        if num_committed < num_full:
            num_full = num_committed
        num_full //= self.block_size
        rec = self.requests.get(rid, _NONE)
        done = rec.num_cached
        if num_full <= done:
            return
        hashes = rec.hashes
        extend_block_hashes(hashes, request.all_token_ids, self.block_size, num_full)
        held = rec.blocks
        cache_block = self.pool.cache_block
        if self.pool.events is None:
            for i in range(done, num_full):
                cache_block(held[i], hashes[i])
        else:  # described for subscribers: the parent's hash and the block's tokens
            tokens, size = request.all_token_ids, self.block_size
            for i in range(done, num_full):
                cache_block(held[i], hashes[i], hashes[i - 1] if i else None,
                            tuple(tokens[i * size:(i + 1) * size]))
        rec.num_cached = num_full

    def free(self, request) -> None:
        """Release every block of the request (tail first) and forget it."""
        rec = self.requests.pop(request.request_id)
        if rec is None:
            return
        if self.journal is not None:
            self.journal.record(self._undo_free, request.request_id, rec)
        if rec.blocks:
            self.pool.free_blocks(rec.blocks[::-1])

    def _undo_free(self, dirty: bool, rid: str, rec: RequestBlocks) -> None:
        self.requests.set(rid, rec)

    # ------------------------------------------------------------------ checks
    def num_blocks_held(self, request_id: str) -> int:
        return len(self.requests.get(request_id, _NONE).blocks)

    def num_cached_blocks(self, request_id: str) -> int:
        return self.requests.get(request_id, _NONE).num_cached

    def check_integrity(self) -> None:
        """Invariant 4 of docs/DESIGN.md: free + held (counted once) == total; refs match holders."""
        pool = self.pool
        pool.check_integrity()
        refs: dict[int, int] = {}
        for rid, rec in self.requests.items():
            ids = [b.block_id for b in rec.blocks]
            assert ids == rec.block_ids, f"{rid}: block table out of sync"
            assert len(set(ids)) == len(ids), f"{rid} holds a block twice"
            for b in rec.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
            assert rec.num_cached <= len(rec.blocks)
        for block in pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != holders {refs.get(block.block_id, 0)}")
        assert pool.num_free_blocks + len(refs) == pool.num_blocks
