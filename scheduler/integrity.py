"""Invariant checks over scheduler + KV cache (docs/DESIGN.md invariants 3-6).

Called by tests and the fuzzer after every operation; cheap enough for that, not for serving.
"""

from __future__ import annotations

from tokenbudget.scheduler.request import RequestStatus


def check_scheduler_integrity(sched) -> None:
    cfg = sched.config
    kv = sched.kv
    bs = cfg.block_size
    running = sched.running
    assert len(running) <= cfg.max_num_seqs, "more running requests than max_num_seqs"
    assert len({id(r) for r in running}) == len(running), "a request is running twice"
    keys = [sched._key(r) for r in running]
    assert keys == sorted(keys), "running list out of policy order"
    waiting = list(sched.waiting)
    assert len(running) + len(waiting) == len(sched.requests), "requests lost between queues"
    for r in running:
        rid = r.request_id
        assert sched.requests.get(rid) is r and r.status == RequestStatus.RUNNING
        c = r.num_computed_tokens
        if not sched.in_step:
            # Invariant 3: between steps nothing past the committed tokens is computed.
            assert 0 <= c <= r.num_tokens - 1, f"{rid}: num_computed_tokens {c} vs {r.num_tokens} tokens"
        assert r.num_tokens <= cfg.max_model_len, f"{rid}: running past max_model_len"
        assert len(r.spec_token_ids) <= max(0, cfg.max_model_len - r.num_tokens), f"{rid}: drafts past max_model_len"
        keep = min(c + cfg.num_lookahead_tokens, max(c, cfg.max_model_len))
        expected = -(-keep // bs)
        held = kv.num_blocks_held(rid)
        assert held == expected, f"{rid}: holds {held} blocks, its {c} computed tokens need {expected}"
        # Invariant 5: hashed blocks hold only computed, committed tokens.
        assert kv.num_cached_blocks(rid) * bs <= min(c, r.num_tokens), f"{rid}: a hashed block holds a draft"
    for r in waiting:
        rid = r.request_id
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        # Invariant 6.
        assert kv.num_blocks_held(rid) == 0, f"waiting {rid} holds blocks"
        assert r.num_computed_tokens == 0 and not r.spec_token_ids, f"waiting {rid} has computed tokens or drafts"
    held_ids = {rid for rid, rec in kv.requests.items() if rec.blocks}
    assert held_ids <= {r.request_id for r in running}, "blocks held by a request that is not running"
    kv.check_integrity()
    if not sched.requests:
        assert kv.num_free_blocks == kv.num_blocks, "every request is done but blocks are still held"
