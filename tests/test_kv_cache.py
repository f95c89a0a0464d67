"""Unit tests of BlockPool and KVCacheManager: allocation, rewind, lookahead, prefix caching, LRU."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tokenbudget.kv_cache.block_pool import BlockPool
from tokenbudget.kv_cache.manager import KVCacheManager


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def state(kv: KVCacheManager):
    pool = kv.pool
    return (list(pool.free_queue), [(b.ref_cnt, b.block_hash) for b in pool.blocks], dict(pool.cached),
            {rid: (list(rec.block_ids), rec.num_cached) for rid, rec in kv.requests.items()})


def compute(kv: KVCacheManager, req: Req, n: int, lookahead: int = 0) -> list[int]:
    """Allocate n positions, mark them computed, hash full committed blocks (as the scheduler does)."""
    ids = kv.allocate_slots(req, n, lookahead)
    assert ids is not None
    req.num_computed_tokens += n
    kv.cache_blocks(req)
    kv.check_integrity()
    return list(ids)


# ---------------------------------------------------------------------------------- allocation
def test_allocate_reserves_ceil_blocks_and_reuses_held_ones():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    r = Req("r", list(range(1, 8)))
    assert len(kv.allocate_slots(r, 7)) == 2
    r.num_computed_tokens = 7
    assert len(kv.allocate_slots(r, 1)) == 2  # position 7 still fits block 1
    r.num_computed_tokens = 8
    assert len(kv.allocate_slots(r, 1)) == 3
    assert kv.num_free_blocks == 7
    kv.check_integrity()


def test_allocate_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(num_blocks=5, block_size=4, max_model_len=64)
    a, b = Req("a", list(range(1, 13))), Req("b", list(range(1, 9)))
    compute(kv, a, 12)  # 3 blocks, hashed
    before = state(kv)
    assert kv.allocate_slots(b, 9) is None  # needs 3, only 2 free
    assert state(kv) == before
    assert "b" not in kv.requests
    r = Req("a", a.all_token_ids, 12)
    assert kv.allocate_slots(r, 4, num_lookahead_tokens=8) is None  # 24 tokens -> 6 blocks > 5
    assert state(kv) == before
    kv.check_integrity()


def test_allocate_counts_revived_prefix_hits_as_taken_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4, max_model_len=64)
    a = Req("a", list(range(1, 10)))
    compute(kv, a, 9)  # 3 blocks, 2 full ones hashed
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = Req("b", list(range(1, 9)) + [50, 51, 52, 53, 54, 55, 56, 57])  # 16 tokens, first 8 shared
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = state(kv)
    # 2 revived hits + 3 new blocks (to 20 tokens) = 5 > 4 free: refused, nothing changed.
    assert kv.allocate_slots(b, 12, 0, hits, num_hit) is None
    assert state(kv) == before
    ids = kv.allocate_slots(b, 8, 0, hits, num_hit)
    assert ids[:2] == [h.block_id for h in hits] and len(ids) == 4
    assert kv.num_free_blocks == 0
    kv.check_integrity()


# ---------------------------------------------------------------------------------- rewind
def test_rewind_frees_exactly_the_rejected_tail():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    r = Req("r", list(range(1, 6)))
    compute(kv, r, 4)  # positions 0..3 computed; token 4 committed, not computed
    ids = kv.allocate_slots(r, 1 + 6)  # verify 1 + 6 drafts: positions 4..10 -> 3 blocks
    assert len(ids) == 3
    tail = ids[2]
    r.num_computed_tokens = 4 + 7 - 5  # accepted 1 of 6: 6 computed -> 2 blocks
    free_before = kv.num_free_blocks
    assert kv.rewind(r) == 1
    assert kv.get_block_ids("r") == ids[:2]
    assert kv.num_free_blocks == free_before + 1
    assert list(kv.pool.free_queue)[-1] == tail  # freed block joins the back of the queue
    assert kv.rewind(r) == 0  # idempotent
    kv.check_integrity()


def test_rewind_keeps_the_lookahead_and_respects_max_model_len():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_model_len=16)
    r = Req("r", list(range(1, 6)))
    assert len(kv.allocate_slots(r, 5, num_lookahead_tokens=3)) == 2  # 8 slots
    r.num_computed_tokens = 5
    ids = kv.allocate_slots(r, 1 + 4, num_lookahead_tokens=3)  # 10 + 3 = 13 -> 4 blocks
    assert len(ids) == 4
    r.num_computed_tokens = 6  # all 4 drafts rejected
    assert kv.rewind(r, num_lookahead_tokens=3) == 1  # keep ceil((6 + 3) / 4) = 3
    assert kv.num_blocks_held("r") == 3
    # Near max_model_len the lookahead is capped: 14 + 3 > 16 -> keep 16 slots, 4 blocks.
    r.num_computed_tokens = 12
    assert len(kv.allocate_slots(r, 2, num_lookahead_tokens=3)) == 4
    kv.check_integrity()


def test_lookahead_reservation():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    r = Req("r", [1, 2, 3])
    assert len(kv.allocate_slots(r, 3, num_lookahead_tokens=0)) == 1
    kv.free(r)
    r2 = Req("r2", [1, 2, 3])
    assert len(kv.allocate_slots(r2, 3, num_lookahead_tokens=2)) == 2  # 3 + 2 = 5 slots
    assert len(kv.allocate_slots(Req("r3", [1]), 1, num_lookahead_tokens=7)) == 2


# ---------------------------------------------------------------------------------- prefix caching
def test_only_full_blocks_of_committed_computed_tokens_are_hashed():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    r = Req("r", list(range(1, 7)))  # 6 committed tokens
    compute(kv, r, 5)
    assert kv.num_cached_blocks("r") == 1  # block 0 full and computed; block 1 partial
    # Drafts computed past the committed tokens (optimistic advance) must not get hashed.
    kv.allocate_slots(r, 1 + 4)
    r.num_computed_tokens = 10
    kv.cache_blocks(r)
    assert kv.num_cached_blocks("r") == 1  # min(10 computed, 6 committed) // 4
    r.all_token_ids += [7, 8]
    kv.cache_blocks(r)
    assert kv.num_cached_blocks("r") == 2
    hashed = [b for b in kv.pool.blocks if b.block_hash is not None]
    assert [b.block_id for b in hashed] == kv.get_block_ids("r")[:2]
    kv.check_integrity()


@pytest.mark.parametrize("prompt_len,expected_hit", [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)])
def test_hit_never_covers_the_last_token(prompt_len, expected_hit):
    kv = KVCacheManager(num_blocks=20, block_size=4, max_model_len=64)
    a = Req("a", list(range(1, 17)))
    compute(kv, a, 16)
    hits, num_hit = kv.get_computed_blocks(Req("b", list(range(1, prompt_len + 1))))
    assert num_hit == expected_hit == 4 * len(hits)
    assert num_hit <= prompt_len - 1


def test_hit_stops_at_the_first_differing_block():
    kv = KVCacheManager(num_blocks=20, block_size=2, max_model_len=64)
    compute(kv, Req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]), 8)
    _, n = kv.get_computed_blocks(Req("b", [1, 2, 3, 4, 9, 6, 7, 8, 9]))
    assert n == 4  # block [5, 6] differs at 9; the chained hash also stops [7, 8]


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=20, block_size=2, max_model_len=64, enable_prefix_caching=False)
    compute(kv, Req("a", [1, 2, 3, 4, 5]), 4)
    assert kv.get_computed_blocks(Req("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert not kv.pool.cached


def test_shared_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=20, block_size=4, max_model_len=64)
    a = Req("a", list(range(1, 10)))
    compute(kv, a, 9)
    b = Req("b", list(range(1, 10)))
    hits, n = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 9 - n, 0, hits, n)
    shared = kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[:2] == shared
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    kv.check_integrity()
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert not any(i in kv.pool.free_queue for i in shared)
    kv.free(b)
    assert kv.num_free_blocks == 20
    kv.check_integrity()


# ---------------------------------------------------------------------------------- eviction order
def test_lru_eviction_order_of_freed_hashed_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=2, max_model_len=64)
    a, b = Req("a", [1, 2, 3, 4, 5]), Req("b", [7, 8, 9, 10, 11])
    a_ids = compute(kv, a, 4)  # 2 full hashed blocks each
    b_ids = compute(kv, b, 4)
    kv.free(a)  # freed first -> evicted first; within a request, tail first
    kv.free(b)
    queue = list(kv.pool.free_queue)
    never_used = [i for i in range(6) if i not in a_ids + b_ids]
    assert queue == never_used + a_ids[::-1] + b_ids[::-1]
    # Allocating uses never-used blocks first, then evicts a's tail block, then a's head ...
    c = Req("c", [20] * 6)
    kv.allocate_slots(c, 6)  # 3 blocks: 2 never used + a's tail
    assert kv.get_computed_blocks(Req("a2", [1, 2, 3, 4, 5]))[1] == 2  # a's head block survives
    assert kv.pool.num_evictions == 1
    assert kv.get_computed_blocks(Req("b2", [7, 8, 9, 10, 11]))[1] == 4  # b untouched
    kv.allocate_slots(Req("d", [30]), 1)  # next victim: a's head
    assert kv.get_computed_blocks(Req("a3", [1, 2, 3, 4, 5]))[1] == 0
    assert kv.get_computed_blocks(Req("b3", [7, 8, 9, 10, 11]))[1] == 4
    kv.check_integrity()


def test_touch_moves_a_hit_out_of_the_free_queue_and_refreshes_lru():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], 111)
    pool.free_blocks(blocks[::-1])
    assert list(pool.free_queue) == [2, 3, 1, 0]
    pool.touch([blocks[0]])
    assert 0 not in pool.free_queue and blocks[0].ref_cnt == 1
    pool.free_blocks([blocks[0]])
    assert list(pool.free_queue) == [2, 3, 1, 0]  # back of the queue again: most recently used
    pool.check_integrity()


def test_pool_errors_and_first_writer_wins():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="cannot allocate"):
        pool.get_new_blocks(4)
    x, y = pool.get_new_blocks(2)
    pool.cache_block(x, 7)
    pool.cache_block(y, 7)  # same content elsewhere: the first block keeps the hash
    assert pool.lookup(7) is x and y.block_hash is None
    assert not pool.reset_prefix_cache()  # blocks still in use
    pool.free_blocks([x, y])
    assert pool.reset_prefix_cache() and pool.lookup(7) is None
    pool.check_integrity()


def test_free_is_tail_first_and_forgets_the_request():
    kv = KVCacheManager(num_blocks=8, block_size=2, max_model_len=64)
    r = Req("r", list(range(1, 8)))
    ids = compute(kv, r, 7)
    kv.free(r)
    assert list(kv.pool.free_queue)[-len(ids):] == ids[::-1]
    assert "r" not in kv.requests and kv.get_block_ids("r") == []
    kv.free(r)  # freeing twice is harmless
    kv.check_integrity()
