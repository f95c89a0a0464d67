"""Bad input gets a ValueError naming the problem and disturbs nothing else (docs/DESIGN.md conventions).

Each bad request is offered to a scheduler that is mid-flight (requests running, blocks held,
some waiting); the whole scheduler state must be unchanged afterwards, and the good requests must
still finish with their reference outputs and leave every block free.
"""

from __future__ import annotations

import pytest

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.testing.fake_model import FakeModelSpec
from tokenbudget.testing.harness import Harness

CFG = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3, max_model_len=64, block_size=4,
                      num_blocks=24, enable_prefix_caching=True)


def snapshot(sched):
    kv = sched.kv
    return (
        sorted(sched.requests),
        [r.request_id for r in sched.running],
        [r.request_id for r in sched.waiting],
        kv.num_free_blocks,
        list(kv.pool.free_queue),
        {rid: list(rec.block_ids) for rid, rec in kv.requests.items()},
        {rid: (r.num_computed_tokens, list(r.all_token_ids), list(r.spec_token_ids), r.status)
         for rid, r in sched.requests.items()},
        sched._next_arrival,
    )


@pytest.fixture
def busy():
    """A harness mid-flight: 3 running (one with drafts), 2 waiting."""
    h = Harness(CFG, FakeModelSpec(), seed=1)
    for i in range(5):
        h.add(h.make_request(f"g{i}", [1 + i, 2, 3, 4, 5, 6, 7, 8, 9][: 3 + i], max_tokens=12, ignore_eos=True))
    for _ in range(3):
        h.step(k=2, p_correct=0.5)
    assert h.scheduler.running and len(h.scheduler.waiting)
    return h


def _finish_cleanly(h: Harness) -> None:
    h.run_until_done(k=3, p_correct=0.6)
    h.check_lossless()
    assert set(h.finished) == set(h.submitted)
    kv = h.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"


BAD_REQUESTS = {
    "duplicate": (lambda h: h.make_request("g0", [1, 2, 3]), "duplicate"),
    "duplicate-waiting": (lambda h: h.make_request("g4", [1, 2, 3]), "duplicate"),
    "too-long": (lambda h: h.make_request("x", [1] * (CFG.max_model_len + 1)), "max_model_len"),
    "empty": (lambda h: h.make_request("x", []), "empty"),
    "max-tokens-0": (lambda h: h.make_request("x", [1, 2], max_tokens=0), "max_tokens"),
    "max-tokens-negative": (lambda h: h.make_request("x", [1, 2], max_tokens=-3), "max_tokens"),
    "min-tokens-negative": (lambda h: h.make_request("x", [1, 2], min_tokens=-1), "min_tokens"),
    "empty-id": (lambda h: h.make_request("", [1, 2]), "request_id"),
    "non-str-id": (lambda h: h.make_request(7, [1, 2]), "request_id"),
    "has-output": (lambda h: Request("x", [1, 2], all_token_ids=[1, 2, 3]), "new request"),
    "has-drafts": (lambda h: Request("x", [1, 2], spec_token_ids=[4]), "new request"),
}


@pytest.mark.parametrize("kind", sorted(BAD_REQUESTS))
def test_bad_request_raises_and_changes_nothing(busy, kind):
    make, words = BAD_REQUESTS[kind]
    before = snapshot(busy.scheduler)
    with pytest.raises(ValueError, match=words):
        busy.scheduler.add_request(make(busy))
    assert snapshot(busy.scheduler) == before
    busy.scheduler.check_integrity()
    _finish_cleanly(busy)


def test_request_that_can_never_fit_the_pool():
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3, max_model_len=64, block_size=4, num_blocks=6)
    h = Harness(cfg, FakeModelSpec())
    h.add(h.make_request("ok", [1, 2, 3], max_tokens=10, ignore_eos=True))
    h.step()
    before = snapshot(h.scheduler)
    # 20 prompt + 10 output = 30 tokens = 8 blocks > 6 in the whole pool: it could never run.
    with pytest.raises(ValueError, match="never fit"):
        h.scheduler.add_request(h.make_request("huge", list(range(1, 21)), max_tokens=10))
    assert snapshot(h.scheduler) == before
    # The same prompt with a max_tokens that fits is fine (max_model_len / max_tokens bound the need).
    h.add(h.make_request("fits", list(range(1, 21)), max_tokens=4, ignore_eos=True))
    _finish_cleanly(h)


def test_never_fit_counts_the_lookahead():
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_model_len=64, block_size=4, num_blocks=6,
                          num_lookahead_tokens=3)
    h = Harness(cfg, FakeModelSpec())
    with pytest.raises(ValueError, match="never fit"):
        h.scheduler.add_request(h.make_request("x", list(range(1, 21)), max_tokens=2))  # 22 + 3 > 24 slots
    h.add(h.make_request("y", list(range(1, 20)), max_tokens=2, ignore_eos=True))  # 21 + 3 = 24 slots
    _finish_cleanly(h)


def test_abort_unknown_or_finished_id_is_a_noop(busy):
    before = snapshot(busy.scheduler)
    assert busy.core.abort_request("no-such-id") is None
    assert busy.scheduler.finish_request("also-unknown", RequestStatus.FINISHED_ABORTED) is None
    assert snapshot(busy.scheduler) == before
    _finish_cleanly(busy)
    before = snapshot(busy.scheduler)
    assert busy.core.abort_request("g0") is None  # finished long ago
    assert snapshot(busy.scheduler) == before


def test_abort_one_running_and_one_waiting_leaves_the_rest_correct(busy):
    sched = busy.scheduler
    running_id = sched.running[0].request_id
    waiting_id = next(iter(sched.waiting)).request_id
    busy.abort(running_id)
    busy.abort(waiting_id)
    sched.check_integrity()
    assert running_id not in sched.requests and waiting_id not in sched.requests
    _finish_cleanly(busy)
    assert busy.finished[running_id] == busy.finished[waiting_id] == "abort"


def test_duplicate_id_is_allowed_again_after_the_first_finished():
    h = Harness(CFG, FakeModelSpec())
    h.add(h.make_request("same", [1, 2, 3], max_tokens=2, ignore_eos=True))
    h.run_until_done()
    h.scheduler.add_request(h.make_request("same", [4, 5, 6], max_tokens=2, ignore_eos=True))
    assert "same" in h.scheduler.requests


# ---------------------------------------------------------------------------------- configs
POSITIVE = ["max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "num_blocks"]
NON_NEGATIVE = ["long_prefill_token_threshold", "num_lookahead_tokens"]


@pytest.mark.parametrize("field", POSITIVE)
@pytest.mark.parametrize("value", [0, -1, 1.5, "8", True, None])
def test_bad_positive_config_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


@pytest.mark.parametrize("field", NON_NEGATIVE)
@pytest.mark.parametrize("value", [-1, 2.0, "1", False, None])
def test_bad_non_negative_config_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


@pytest.mark.parametrize("value", ["lifo", "FCFS", "", None, 1])
def test_bad_policy(value):
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy=value)


@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_bad_enable_prefix_caching(value):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        SchedulerConfig(enable_prefix_caching=value)


def test_lookahead_must_leave_budget():
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        SchedulerConfig(max_num_batched_tokens=4, num_lookahead_tokens=4)
    SchedulerConfig(max_num_batched_tokens=4, num_lookahead_tokens=3)


def test_good_edge_values_are_accepted():
    SchedulerConfig(max_num_batched_tokens=1, max_num_seqs=1, max_model_len=1, block_size=1, num_blocks=1,
                    long_prefill_token_threshold=0, num_lookahead_tokens=0, policy="priority",
                    enable_prefix_caching=False)
