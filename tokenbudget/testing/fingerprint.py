"""Everything a step may change, as one comparable value (to check that a rollback restores it),
and the check that no table outlives its request.

``state_fingerprint(core)`` covers every ``RequestTable`` (the scheduler's requests, the block
tables (ids and cached blocks; the hashes are a cache of the tokens), and ``EngineCore.tables``:
the output states, the grammar matchers, the proposer's and the draft-length controller's
records; each record by value), the scheduler's queues and their order, the block pool
(free-queue order, reference counts, hashes, evictions), the prefix-cache counters and the
speculator's metrics. ``TransactionChecker`` wraps an
``EngineCore`` so that every failed step attempt is compared with the state before it.

After a rollback from a fault *before* the forward pass the fingerprint must be identical. After
a fault during or after the forward pass, two things may differ on purpose (``kv_cache.journal``):
requests preempted by the failed step stay preempted (their scheduler record and block table),
and the blocks the failed step handed out have no prefix-cache hash (their slots may hold its KV:
a hash given back would serve that KV to the next request with the prefix, wrong tokens); every
other block's hash is as it was. ``compare_after_rollback`` checks exactly that.

``check_tables(core)``: between steps, every table holds only requests in flight (a finished
request's records are released on the engine's one release path; a child's link to its parent
until its final output was gathered).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenbudget.engine.text.detokenizer import IncrementalDetokenizer
from tokenbudget.kv_cache.block import KVBlock
from tokenbudget.request_table import EngineRecord
from tokenbudget.scheduler.request import Request, RequestStatus

_SCALARS = (int, float, str, bytes, bool, type(None))
_MOVES_ON_DIRTY = ("scheduler requests", "kv blocks")  # a preemption a dirty rollback keeps


def record_value(x: Any, nested: bool = False) -> Any:
    """A record as a comparable value: its fields, recursively; a request it points to by id, a
    block by number, a detokenizer by its state, an object without fields (a matcher, a tensor)
    by identity."""
    if isinstance(x, _SCALARS):
        return x
    if isinstance(x, Request) and nested:
        return ("request", x.request_id)
    if isinstance(x, KVBlock):
        return ("block", x.block_id)
    if isinstance(x, IncrementalDetokenizer):  # by value: a step's text lives in the output record's copy
        return ("detokenizer",) + tuple(record_value(getattr(x, s), True) for s in x.__slots__ if s != "_tok")
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__,) + tuple(record_value(getattr(x, f.name), True) for f in dataclasses.fields(x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(record_value(v, True) for v in x)
    if isinstance(x, (set, frozenset)):
        return ("set",) + tuple(sorted(repr(record_value(v, True)) for v in x))
    if isinstance(x, dict):
        return ("dict",) + tuple((repr(k), record_value(v, True)) for k, v in x.items())
    return ("object", type(x).__name__, id(x))


def table_fingerprint(core) -> dict[str, dict]:
    sched = core.scheduler
    out = {table.name: {repr(rid): record_value(rec) for rid, rec in table.items()}
           for table in (sched.requests, *core.tables)}
    out[sched.kv.requests.name] = {repr(rid): (tuple(rec.block_ids), rec.num_cached)
                                   for rid, rec in sched.kv.requests.items() if rec.blocks}
    return out


def state_fingerprint(core) -> dict[str, Any]:
    sched = core.scheduler
    kv = sched.kv
    pool = kv.pool
    return {
        "tables": table_fingerprint(core),
        "running": [r.request_id for r in sched.running],
        "waiting": [r.request_id for r in sched.waiting],
        "prefix_counters": (kv.prefix_queries, kv.prefix_hits),
        "preemptions": sched.num_preemptions,
        "free_queue": tuple(pool.free_queue),
        "refs": tuple(b.ref_cnt for b in pool.blocks),
        "hashes": tuple(b.block_hash for b in pool.blocks),
        "evictions": pool.num_evictions,
        "spec_stats": repr(core.speculator.stats),
    }


def compare_after_rollback(before: dict, after: dict, dirty: bool, handed_out: frozenset[int] = frozenset()) -> None:
    """Assert ``after`` (a rollback's result) is what ``before`` allows; see the module docstring.
    ``handed_out``: the ids of the blocks the failed attempt took from the pool."""
    if not dirty:
        for key in before:
            assert after[key] == before[key], f"rollback changed {key}"
        return
    requests_before = before["tables"]["scheduler requests"]
    preempted = {rid for rid, rec in after["tables"]["scheduler requests"].items()
                 if _status(rec) == RequestStatus.PREEMPTED
                 and _status(requests_before.get(rid)) != RequestStatus.PREEMPTED}
    for name, records in before["tables"].items():
        now = after["tables"][name]
        keep = preempted if name in _MOVES_ON_DIRTY else set()
        assert {r: v for r, v in now.items() if r not in keep} == {r: v for r, v in records.items() if r not in keep}, (
            f"rollback changed the table {name!r}")
    for key in ("prefix_counters", "spec_stats"):
        assert after[key] == before[key], f"rollback changed {key}"
    for i, (h_before, h_after) in enumerate(zip(before["hashes"], after["hashes"])):
        if i in handed_out:
            assert h_after is None, f"block {i}, handed out by the failed step, has a prefix-cache hash ({h_after})"
        else:
            assert h_after == h_before, f"block {i} changed its hash in a rollback ({h_before} -> {h_after})"


def _status(value) -> int | None:
    """A scheduler record's status (``record_value`` of a ``Request``)."""
    if value is None:
        return None
    names = [f.name for f in dataclasses.fields(Request)]
    return value[1 + names.index("status")]


def check_tables(core) -> None:
    """Between steps: no table holds a request that is not in flight (module docstring)."""
    live = set(core.scheduler.requests)
    for table in (core.scheduler.kv.requests, *core.tables):
        if isinstance(table, EngineRecord):
            continue
        stale = set(table) - live
        assert not stale, f"the table {table.name!r} still holds finished requests {sorted(stale)}"
    outputs = core.outputs
    assert set(outputs.children) <= live, f"links of finished children {sorted(set(outputs.children) - live)}"
    assert set(outputs.parents) <= {outputs.parent_id(rid) for rid in live}, "a parent with no child in flight"


class RollbackMismatch(BaseException):
    """A failed attempt's rollback left the state other than it found it. Not an ``Exception``:
    the engine retries and isolates those, which would swallow the verdict."""


class TransactionChecker:
    """Wraps ``core._attempt``: after every failed attempt, compare the state with the one
    before it (``compare_after_rollback``; a mismatch raises ``RollbackMismatch`` out of the
    step). ``dirty`` is whether the runner was reached."""

    def __init__(self, core) -> None:
        self.core = core
        self.num_checked = 0
        self.num_dirty = 0  # failed attempts rolled back after a forward pass
        self.num_dirty_evictions = 0  # ... whose attempt had evicted a cached block
        inner_attempt, runner, pool = core._attempt, core.runner, core.scheduler.kv.pool
        real_execute, real_new_blocks = runner.execute, pool.get_new_blocks
        self._reached_runner = False
        self._handed_out: set[int] = set()

        def get_new_blocks(n):
            blocks = real_new_blocks(n)
            self._handed_out.update(b.block_id for b in blocks)
            return blocks

        pool.get_new_blocks = get_new_blocks

        def execute(sched):
            self._reached_runner = True
            return real_execute(sched)

        runner.execute = execute

        def attempt(only):
            before = state_fingerprint(core)
            self._reached_runner = False
            self._handed_out.clear()
            try:
                return inner_attempt(only)
            except BaseException:
                if core.dead is None:
                    if self._reached_runner:
                        self.num_dirty += 1
                        self.num_dirty_evictions += any(before["hashes"][i] is not None for i in self._handed_out)
                    try:
                        compare_after_rollback(before, state_fingerprint(core), self._reached_runner,
                                               frozenset(self._handed_out))
                    except AssertionError as mismatch:
                        raise RollbackMismatch(str(mismatch)) from mismatch
                    self.num_checked += 1
                raise

        core._attempt = attempt
