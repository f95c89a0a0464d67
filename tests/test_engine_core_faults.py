"""One test per fault class on the EngineCore over the fake model (``testing``).

Each runs the same requests on a faulty engine and a fault-free twin (same seed, same drafts):
the twin's outputs are the fault-free run the faulty engine must reproduce for every request
that is not tied to a fault. Every failed attempt is checked rolled back (``TransactionChecker``)
and every block is free at the end. The Hypothesis state machine mixes all of these at random;
these pin each promise down by name.
"""

from __future__ import annotations

import pytest

from tokenbudget import EngineDeadError
from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.testing.faults import FaultInjectingProposer, FaultInjectingRunner, FaultPlan
from tokenbudget.testing.fingerprint import TransactionChecker
from tokenbudget.testing.harness import Harness

CONFIG = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64, block_size=4,
                         num_blocks=64, enable_prefix_caching=True)
PROMPTS = {f"r{i}": [3 + i, 5, 7 + 2 * i, 11, 13, 2 + i] for i in range(5)}


def _pair(runner_plan: FaultPlan | None = None, proposer_plan: FaultPlan | None = None):
    wrap = (lambda r: FaultInjectingRunner(r, runner_plan)) if runner_plan is not None else None
    h = Harness(CONFIG, seed=7, wrap_runner=wrap)
    if proposer_plan is not None:
        h.core.speculator.proposer = FaultInjectingProposer(h.drafter, proposer_plan)
    checker = TransactionChecker(h.core)
    twin = Harness(CONFIG, seed=7)
    for rid, prompt in PROMPTS.items():
        for x in (h, twin):
            x.add(x.make_request(rid, prompt, max_tokens=12, ignore_eos=True))
    return h, twin, checker


def _run(h: Harness, twin: Harness, steps_before: int = 2, k: int = 3) -> None:
    for x in (h, twin):
        for _ in range(steps_before):
            x.step(k, 0.6)


def _finish(h: Harness, twin: Harness, k: int = 3) -> None:
    h.run_until_done(k, 0.6)
    twin.run_until_done(k, 0.6)
    for x in (h, twin):
        x.check_lossless()
        assert x.scheduler.kv.num_free_blocks == x.scheduler.kv.num_blocks


@pytest.mark.parametrize("late", [False, True])
def test_transient_runner_fault_retried_invisibly(late) -> None:
    plan = FaultPlan(late=late)
    h, twin, checker = _pair(plan)
    _run(h, twin)
    plan.transient = 1
    _finish(h, twin)
    assert h.outputs == twin.outputs and h.finished == twin.finished
    assert plan.num_fired == 1 and checker.num_checked == 1 and h.core.num_errored_requests == 0


def test_transient_proposer_fault_retried_invisibly() -> None:
    plan = FaultPlan()
    h, twin, checker = _pair(proposer_plan=plan)
    _run(h, twin)
    plan.transient = 1
    _finish(h, twin)
    assert h.outputs == twin.outputs and plan.num_fired == 1 and checker.num_checked == 1


def test_malformed_runner_output_rejected_and_retried() -> None:
    plan = FaultPlan()
    h, twin, checker = _pair(plan)
    _run(h, twin)
    plan.malformed = True
    _finish(h, twin)
    assert h.outputs == twin.outputs and plan.num_fired == 1 and checker.num_checked == 1


@pytest.mark.parametrize("where", ["runner", "runner_late", "proposer"])
def test_request_tied_fault_ends_only_that_request(where) -> None:
    plan = FaultPlan(late=where == "runner_late")
    h, twin, checker = _pair(*((None, plan) if where == "proposer" else (plan, None)))
    _run(h, twin)
    plan.poisoned.add("r3")
    _finish(h, twin)
    assert h.finished.pop("r3") == "error" and "InjectedFault" in h.errors["r3"]
    twin.finished.pop("r3")
    assert h.finished == twin.finished
    assert {rid: out for rid, out in h.outputs.items() if rid != "r3"} == {
        rid: out for rid, out in twin.outputs.items() if rid != "r3"}
    assert h.core.is_healthy() and checker.num_checked >= 2


def test_keyboard_interrupt_rolls_back_and_propagates() -> None:
    plan = FaultPlan(late=True)
    h, twin, checker = _pair(plan)
    _run(h, twin)
    plan.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        h.step(3, 0.6)
    assert checker.num_checked == 1 and h.core.is_healthy()
    _finish(h, twin)
    assert h.outputs == twin.outputs


def test_engine_wide_fault_kills_the_engine_and_frees_everything() -> None:
    plan = FaultPlan()
    h, twin, _ = _pair(plan)
    _run(h, twin)
    plan.engine_wide = True
    with pytest.raises(EngineDeadError) as info:
        h.step(3, 0.6)
    assert sorted(info.value.failed_alone) == sorted(PROMPTS)  # every request failed alone too
    assert not h.core.is_healthy() and not h.scheduler.requests
    kv = h.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()
    with pytest.raises(EngineDeadError):
        h.core.step()
    with pytest.raises(EngineDeadError):
        h.core.add_request(h.make_request("late", [1, 2]))


def test_lone_request_failing_step_after_step_kills_the_engine() -> None:
    """One request at a time, each failing alone: a bad request each, or a broken engine? After
    ``max_failed_steps`` steps in a row with no progress, the engine says broken."""
    h = Harness(CONFIG, wrap_runner=lambda r: FaultInjectingRunner(r, FaultPlan(engine_wide=True)))
    for i in range(h.core.max_failed_steps - 1):
        h.add(h.make_request(f"lone{i}", [1, 2, 3]))
        h.step()
        assert h.finished[f"lone{i}"] == "error" and h.core.is_healthy()
    h.add(h.make_request("last", [1, 2, 3]))
    with pytest.raises(EngineDeadError) as info:
        h.step()
    assert info.value.failed_alone == []
    assert h.scheduler.kv.num_free_blocks == h.scheduler.kv.num_blocks


def test_bad_requests_next_to_a_healthy_one_never_kill_the_engine() -> None:
    """A new bad request every step, next to a healthy one that keeps making progress: each bad
    one ends alone, the failed-step count stays at zero, the healthy output is untouched."""
    plan = FaultPlan()
    h = Harness(CONFIG, wrap_runner=lambda r: FaultInjectingRunner(r, plan))
    h.add(h.make_request("healthy", [4, 6, 8], max_tokens=40, ignore_eos=True))
    for i in range(3 * h.core.max_failed_steps):
        h.add(h.make_request(f"bad{i}", [9, 9, i + 1]))
        plan.poisoned.add(f"bad{i}")
        h.step()
        assert h.finished[f"bad{i}"] == "error" and h.core.failed_steps_in_a_row == 0
    h.run_until_done()
    h.check_lossless()
    assert h.finished["healthy"] == "length" and h.core.is_healthy()
