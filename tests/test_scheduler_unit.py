"""Unit tests of the token-budget scheduler: chunking, thresholds, policies, preemption, prefix hits."""

from __future__ import annotations

import pytest

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.testing.fake_model import FakeModelSpec
from tokenbudget.testing.harness import Harness

from engine_fixtures import bounded

SPEC = FakeModelSpec()


def cfg(**kw) -> SchedulerConfig:
    base = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128, block_size=4, num_blocks=64)
    base.update(kw)
    return SchedulerConfig(**base)


def manual_step(h: Harness, drafts: dict[str, list[int]] | None = None):
    """One engine step (the harness checks invariants before and after); its SchedulerOutput."""
    return h.step(drafts=drafts)


def chunks(out) -> dict[str, int]:
    return {sr.request_id: sr.num_tokens for sr in out.scheduled}


# ---------------------------------------------------------------------------------- chunking
def test_long_prompt_is_chunked_under_the_budget():
    h = Harness(cfg(max_num_batched_tokens=8), SPEC)
    h.add(h.make_request("a", list(range(1, 21)), max_tokens=3, ignore_eos=True))
    sizes, samples = [], []
    for _ in bounded(h.scheduler.has_unfinished_requests):
        out = manual_step(h)
        assert out.total_num_scheduled_tokens <= 8
        sizes.append(out.scheduled[0].num_tokens)
        samples.append(out.scheduled[0].needs_sample)
    assert sizes == [8, 8, 4, 1, 1]
    assert samples == [False, False, True, True, True]
    h.check_lossless()


def test_running_requests_first_then_waiting_share_the_rest_of_the_budget():
    h = Harness(cfg(max_num_batched_tokens=10), SPEC)
    h.add(h.make_request("a", list(range(1, 7)), max_tokens=8, ignore_eos=True))
    assert chunks(manual_step(h)) == {"a": 6}
    h.add(h.make_request("b", list(range(21, 41)), max_tokens=8, ignore_eos=True))  # no shared prefix
    h.add(h.make_request("c", [45, 46, 47], max_tokens=8, ignore_eos=True))
    out = manual_step(h)
    assert [sr.request_id for sr in out.scheduled] == ["a", "b"]
    assert chunks(out) == {"a": 1, "b": 9} and out.total_num_scheduled_tokens == 10
    out = manual_step(h)  # b keeps chunking after a; c gets what is left
    assert chunks(out) == {"a": 1, "b": 9}
    out = manual_step(h)
    assert chunks(out) == {"a": 1, "b": 2, "c": 3}
    h.run_until_done()
    h.check_lossless()


def test_drafts_count_against_the_budget_and_are_clipped():
    h = Harness(cfg(max_num_batched_tokens=4), SPEC)
    h.add(h.make_request("a", [1, 2, 3], max_tokens=20, ignore_eos=True))
    manual_step(h)
    out = manual_step(h, {"a": [9, 9, 9, 9, 9, 9]})  # 1 + 6 > budget 4: only 3 drafts ride along
    sr = out.scheduled[0]
    assert sr.num_tokens == 4 and sr.spec_token_ids == [9, 9, 9]


def test_long_prefill_token_threshold_caps_each_chunk():
    h = Harness(cfg(long_prefill_token_threshold=3), SPEC)
    h.add(h.make_request("a", list(range(1, 11)), max_tokens=2, ignore_eos=True))
    h.add(h.make_request("b", [1, 2], max_tokens=2, ignore_eos=True))
    out = manual_step(h)
    assert chunks(out) == {"a": 3, "b": 2}
    assert chunks(manual_step(h)) == {"a": 3, "b": 1}
    assert chunks(manual_step(h)) == {"a": 3}  # b finished (max_tokens=2)
    assert chunks(manual_step(h)) == {"a": 1}
    h.run_until_done()
    h.check_lossless()


# ---------------------------------------------------------------------------------- policies
def admission_order(policy: str) -> list[str]:
    h = Harness(cfg(max_num_seqs=1, policy=policy), SPEC)
    for rid, prio in [("a", 5), ("b", 0), ("c", 1), ("d", 0)]:
        h.add(h.make_request(rid, [1, 2, 3], max_tokens=2, priority=prio, ignore_eos=True))
    order = []
    for _ in bounded(h.scheduler.has_unfinished_requests):
        for sr in manual_step(h).scheduled:
            if sr.is_new:
                order.append(sr.request_id)
    return order


def test_fcfs_admits_in_arrival_order():
    assert admission_order("fcfs") == ["a", "b", "c", "d"]


def test_priority_admits_lowest_value_first_then_arrival():
    assert admission_order("priority") == ["b", "d", "c", "a"]


# ---------------------------------------------------------------------------------- preemption
def run_until_preemption(h: Harness, max_steps: int = 200):
    for _ in range(max_steps):
        running_before = [r.request_id for r in h.scheduler.running]
        out = manual_step(h)
        if out.preempted_request_ids:
            return out, running_before
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim_and_no_admission_in_that_step(policy):
    # 8 blocks of 4: a and b (8-token prompts, ignore_eos) outgrow the pool together.
    h = Harness(cfg(num_blocks=8, max_model_len=32, policy=policy), SPEC)
    h.add(h.make_request("a", list(range(1, 9)), max_tokens=20, ignore_eos=True, priority=1))
    h.add(h.make_request("b", list(range(11, 19)), max_tokens=20, ignore_eos=True, priority=0))
    manual_step(h)
    h.add(h.make_request("c", [1, 2], max_tokens=2, ignore_eos=True, priority=-5))  # waiting, most urgent
    sched = h.scheduler
    out, running_before = run_until_preemption(h)
    # FCFS: the latest arrival (b); priority: the largest (priority, arrival) key (a, priority 1).
    expected_victim = "b" if policy == "fcfs" else "a"
    if policy == "priority":
        # c (priority -5) was admitted as soon as there was room, so it runs too; a is still the victim.
        assert "c" in running_before or "c" in h.finished
    assert out.preempted_request_ids == [expected_victim]
    assert not any(sr.is_new for sr in out.scheduled), "a waiting request was admitted in a step that preempted"
    victim = next(r for r in sched.waiting if r.request_id == expected_victim)
    assert victim.num_computed_tokens == 0 and not victim.spec_token_ids
    assert sched.kv.num_blocks_held(expected_victim) == 0
    # the victim is next to run again: FCFS puts it back at the head; under priority it is the most
    # urgent waiting request (c, more urgent still, is already running or done)
    assert sched.waiting.peek() is victim
    h.run_until_done()
    h.check_lossless()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_fcfs_preempted_request_goes_back_to_the_head_of_the_queue():
    h = Harness(cfg(num_blocks=8, max_model_len=32, max_num_seqs=2), SPEC)  # c has to wait
    h.add(h.make_request("a", list(range(1, 9)), max_tokens=20, ignore_eos=True))
    h.add(h.make_request("b", list(range(11, 19)), max_tokens=20, ignore_eos=True))
    manual_step(h)
    h.add(h.make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=20, ignore_eos=True))
    run_until_preemption(h)
    assert [r.request_id for r in h.scheduler.waiting] == ["b", "c"]


def test_priority_preempts_for_a_seat_when_max_num_seqs_is_full():
    """Plenty of KV, two seats: an urgent arrival takes the seat of the lowest-ranked running
    request (largest priority, then latest arrival), admitted the step after the preemption (no
    admission in a step that preempted), and the victim resumes once a seat frees, outputs
    unchanged; an arrival that does not outrank the running ones waits."""
    h = Harness(cfg(max_num_seqs=2, policy="priority"), SPEC)
    h.add(h.make_request("a", list(range(1, 9)), max_tokens=12, ignore_eos=True, priority=1))
    h.add(h.make_request("b", list(range(11, 19)), max_tokens=12, ignore_eos=True, priority=1))
    manual_step(h)
    h.add(h.make_request("late", [3, 4, 5], max_tokens=2, ignore_eos=True, priority=1))  # ties: waits
    out = manual_step(h)
    assert not out.preempted_request_ids and "late" not in chunks(out)
    h.add(h.make_request("urgent", [1, 2, 3], max_tokens=2, ignore_eos=True, priority=0))
    out = manual_step(h)
    assert out.preempted_request_ids == ["b"]  # a and b tie on priority: the later arrival goes
    out = manual_step(h)
    assert "urgent" in chunks(out) and [r.request_id for r in h.scheduler.running] == ["urgent", "a"]
    assert [r.request_id for r in h.scheduler.waiting] == ["b", "late"]
    h.run_until_done()
    h.check_lossless()


def test_fcfs_never_preempts_for_a_seat():
    h = Harness(cfg(max_num_seqs=2), SPEC)
    for rid, prio in (("a", 1), ("b", 1)):
        h.add(h.make_request(rid, list(range(1, 9)), max_tokens=12, ignore_eos=True, priority=prio))
    manual_step(h)
    h.add(h.make_request("urgent", [1, 2, 3], max_tokens=2, ignore_eos=True, priority=-9))
    out = manual_step(h)
    assert not out.preempted_request_ids and "urgent" not in chunks(out)


# ---------------------------------------------------------------------------------- prefix cache
def test_prefix_hit_reuses_blocks_and_never_covers_the_last_prompt_token():
    h = Harness(cfg(), SPEC)
    prompt = list(range(1, 17))  # exactly 4 full blocks
    h.add(h.make_request("a", prompt, max_tokens=30, ignore_eos=True))
    manual_step(h)
    manual_step(h)
    a_blocks = list(h.scheduler.kv.get_block_ids("a"))
    h.add(h.make_request("b", prompt, max_tokens=3, ignore_eos=True))
    out = manual_step(h)
    sr = next(sr for sr in out.scheduled if sr.request_id == "b")
    # 16-token prompt: at most (16 - 1) // 4 = 3 blocks hit; the last token is recomputed.
    assert sr.is_new and sr.num_computed_tokens == 12 and sr.num_tokens == 4
    assert h.scheduler.requests["b"].num_cached_tokens == 12
    assert list(sr.block_ids[:3]) == a_blocks[:3] and sr.block_ids[3] != a_blocks[3]
    pool = h.scheduler.kv.pool
    assert [pool.blocks[i].ref_cnt for i in a_blocks[:3]] == [2, 2, 2]
    h.add(h.make_request("c", prompt + [7], max_tokens=3, ignore_eos=True))  # 17 tokens: all 4 blocks hit
    out = manual_step(h)
    sr = next(sr for sr in out.scheduled if sr.request_id == "c")
    assert sr.num_computed_tokens == 16 and sr.num_tokens == 1
    h.run_until_done()
    h.check_lossless()


def test_prefix_hit_after_the_owner_finished_revives_free_blocks():
    h = Harness(cfg(), SPEC)
    prompt = list(range(1, 14))
    h.add(h.make_request("a", prompt, max_tokens=2, ignore_eos=True))
    h.run_until_done()
    kv = h.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    h.add(h.make_request("b", prompt, max_tokens=2, ignore_eos=True))
    out = manual_step(h)
    assert out.scheduled[0].num_computed_tokens == 12
    assert kv.num_free_blocks == kv.num_blocks - 4
    h.run_until_done()
    h.check_lossless()


def test_prefix_caching_off_never_hits():
    h = Harness(cfg(enable_prefix_caching=False), SPEC)
    h.add(h.make_request("a", list(range(1, 14)), max_tokens=4, ignore_eos=True))
    manual_step(h)
    h.add(h.make_request("b", list(range(1, 14)), max_tokens=4, ignore_eos=True))
    out = manual_step(h)
    assert next(sr for sr in out.scheduled if sr.request_id == "b").num_computed_tokens == 0


# ---------------------------------------------------------------------------------- rollback / stops
def test_rejected_drafts_roll_back_and_their_blocks_are_freed():
    h = Harness(cfg(block_size=2), SPEC)
    h.add(h.make_request("a", [1, 2, 3], max_tokens=30, ignore_eos=True))
    manual_step(h)
    r = h.scheduler.requests["a"]
    assert r.num_computed_tokens == 3 and len(r.all_token_ids) == 4
    truth = h.expected("a")
    n = len(h.outputs["a"])
    good, bad = truth[n:n + 2], truth[n + 2] % 63 + 1  # two right drafts, then a wrong one
    out = manual_step(h, {"a": good + [bad, 5, 5, 5]})
    assert out.scheduled[0].num_tokens == 7 and r.num_computed_tokens == 4 + 2  # 4 + 6 drafts - 4 rejected
    assert r.num_computed_tokens == len(r.all_token_ids) - 1 and h.outputs["a"] == truth[:n + 3]
    assert h.scheduler.kv.num_blocks_held("a") == 3  # ceil(6 / 2): the 2 blocks of rejected drafts went back
    h.run_until_done()
    h.check_lossless()


def test_stop_token_and_min_tokens():
    h = Harness(cfg(), SPEC)
    ref_req = h.make_request("ref", [3, 1, 4, 1, 5], max_tokens=10, ignore_eos=True)
    h.add(ref_req)
    h.run_until_done()
    stream = h.outputs["ref"]
    stop = stream[2]
    first = stream.index(stop)
    h.add(h.make_request("s", [3, 1, 4, 1, 5], max_tokens=10, ignore_eos=True, stop_token_ids=frozenset({stop})))
    h.add(h.make_request("m", [3, 1, 4, 1, 5], max_tokens=10, ignore_eos=True, stop_token_ids=frozenset({stop}),
                         min_tokens=first + 2))
    h.run_until_done(k=3, p_correct=0.8)
    assert h.outputs["s"] == stream[:first + 1] and h.finished["s"] == "stop"
    assert not h.scheduler.requests
    assert h.outputs["m"][:first + 1] == stream[:first + 1] and len(h.outputs["m"]) >= first + 2
    h.check_lossless()


def test_max_model_len_finishes_with_length():
    h = Harness(cfg(max_model_len=10), SPEC)
    h.add(h.make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=100, ignore_eos=True))
    h.run_until_done(k=4, p_correct=1.0)
    assert len(h.outputs["a"]) == 4 and h.finished["a"] == "length"
