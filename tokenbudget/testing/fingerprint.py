"""Everything a step may change, as one comparable value (to check that a rollback restores it).

``state_fingerprint(core)`` covers the scheduler (requests' counters, tokens, drafts, status,
queues and their order), the KV-cache manager (block tables, cached-block counts, prefix
counters), the block pool (free-queue order, reference counts, hashes, evictions), the output
processor (per-request tokens, logprobs, text state, speculation counters) and the speculator's
metrics. ``TransactionChecker`` wraps an ``EngineCore`` so that every failed step attempt is
compared with the state before it.

After a rollback from a fault *before* the forward pass the fingerprint must be identical. After
a fault during or after the forward pass, two things may differ on purpose (``kv_cache.journal``):
requests preempted by the failed step stay preempted, and prefix-cache hashes of blocks the failed
step handed out stay evicted. ``compare_after_rollback`` checks exactly that.
"""

from __future__ import annotations

from typing import Any


def state_fingerprint(core) -> dict[str, Any]:
    sched = core.scheduler
    kv = sched.kv
    pool = kv.pool
    requests = {
        rid: (int(r.status), r.num_computed_tokens, tuple(r.all_token_ids), tuple(r.spec_token_ids),
              r.spec_probs is not None, r.num_cached_tokens, r.num_preemptions, r.stop_reason)
        for rid, r in sched.requests.items()}
    outputs = {rid: st.snapshot()[:-1] + (st.detok.snapshot() if st.detok is not None else None,)
               for rid, st in core.outputs.states.items()}
    return {
        "requests": requests,
        "running": [r.request_id for r in sched.running],
        "waiting": [r.request_id for r in sched.waiting],
        "tables": {rid: tuple(ids) for rid, ids in kv.req_block_ids.items()},
        "num_cached": dict(kv.req_num_cached),
        "prefix_counters": (kv.prefix_queries, kv.prefix_hits),
        "preemptions": sched.num_preemptions,
        "free_queue": tuple(pool.free_queue),
        "refs": tuple(b.ref_cnt for b in pool.blocks),
        "hashes": tuple(b.block_hash for b in pool.blocks),
        "evictions": pool.num_evictions,
        "outputs": outputs,
        "spec_stats": repr(core.speculator.stats),
    }


def compare_after_rollback(before: dict, after: dict, dirty: bool) -> None:
    """Assert ``after`` (a rollback's result) is what ``before`` allows; see the module docstring."""
    if not dirty:
        for key in before:
            assert after[key] == before[key], f"rollback changed {key}"
        return
    preempted = {rid for rid, st in after["requests"].items()
                 if st[0] == 2 and before["requests"].get(rid, (None,))[0] != 2}  # RequestStatus.PREEMPTED
    for rid, st in before["requests"].items():
        if rid not in preempted:
            assert after["requests"][rid] == st, f"rollback changed request {rid}"
            assert after["tables"].get(rid) == before["tables"].get(rid), f"rollback changed {rid}'s blocks"
    for key in ("prefix_counters", "outputs", "spec_stats"):
        assert after[key] == before[key], f"rollback changed {key}"
    for i, (h_before, h_after) in enumerate(zip(before["hashes"], after["hashes"])):
        assert h_after in (h_before, None), f"block {i} got a hash it did not have"


class TransactionChecker:
    """Wraps ``core._attempt``: after every failed attempt, compare the state with the one
    before it (``compare_after_rollback``). ``dirty`` is whether the runner was reached."""

    def __init__(self, core) -> None:
        self.core = core
        self.num_checked = 0
        inner_attempt, runner = core._attempt, core.runner
        real_execute = runner.execute
        self._reached_runner = False

        def execute(sched):
            self._reached_runner = True
            return real_execute(sched)

        runner.execute = execute

        def attempt(only):
            before = state_fingerprint(core)
            self._reached_runner = False
            try:
                return inner_attempt(only)
            except BaseException:
                if core.dead is None:
                    compare_after_rollback(before, state_fingerprint(core), self._reached_runner)
                    self.num_checked += 1
                raise

        core._attempt = attempt
