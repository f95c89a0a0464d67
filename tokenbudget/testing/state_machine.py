"""A Hypothesis state machine over the real EngineCore + scheduler + KV cache, a fake model and a
fake drafter, with injected faults and a fault-free twin.

Rules add requests (random prompts, shared prefixes, priorities, limits), add bad ones (which
must raise ValueError and change nothing), abort, step with random drafts and acceptance, and
inject faults (``testing.faults``): transient ones, ones tied to a request (in the
runner or the proposer, before or after the forward pass, after the output processor, or a
malformed runner output), and,
rarely, an engine-wide one that must kill the engine cleanly (and only it, or steps in a row
of requests that are all tied to faults, may). The twin gets the same requests,
aborts and steps without faults.

Checked after every rule: the design's invariants 1-7 (the harness, every step), every failed
step attempt rolled back, every table included (``fingerprint.TransactionChecker``: fingerprints
before and after), no table holding a request that is not in flight (``fingerprint.check_tables``),
every finished request's tokens equal its solo run (invariant 8) and the twin's, and only
requests tied to a fault ended with an error. At teardown both are drained: every request not
aborted and not tied to a fault finished normally with the same tokens in both, and every block
is free.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis import target
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenbudget.api.errors import EngineDeadError
from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.testing.coverage import EventCoverage
from tokenbudget.testing.fake_model import FakeModelSpec
from tokenbudget.testing.faults import FaultInjectingProposer, FaultInjectingRunner, FaultPlan, fail_after_outputs
from tokenbudget.testing.fingerprint import TransactionChecker, check_tables
from tokenbudget.testing.harness import Harness
from tokenbudget.testing.strategies import request_specs, scheduler_configs

SPEC = FakeModelSpec()
# Shared prompt prefixes: the prefix cache hits only whole blocks (up to 16 tokens here), so one of
# them spans two blocks of the largest size.
PREFIXES = {1: [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49], 2: [7, 7, 7, 7, 3, 3, 3, 3, 11, 2],
            3: [(11 * i) % 50 + 3 for i in range(34)]}


class SchedulerMachine(RuleBasedStateMachine):
    """Set ``fixed_config`` (a SchedulerConfig) on a subclass to fuzz one configuration."""

    fixed_config: SchedulerConfig | None = None
    coverage: EventCoverage | None = None  # set on a subclass (``machine_for``) to collect the events reached

    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.twin: Harness | None = None
        self.counter = 0
        self.dead = False
        self.victims: set[str] = set()

    @initialize(config=scheduler_configs(), seed=st.integers(0, 2**16), data=st.data(), n=st.integers(2, 6))
    def setup(self, config: SchedulerConfig, seed: int, data, n: int) -> None:
        """The engine, its fault-free twin, and ``n`` requests in flight: programs start with a
        batch (a program whose first rules step an empty engine or add bad requests reaches
        nothing: 49 % of them stepped no request before)."""
        config = self.fixed_config or config
        self.runner_faults, self.proposer_faults, self.output_faults = FaultPlan(), FaultPlan(), FaultPlan()
        self.h = Harness(config, SPEC, seed=seed, wrap_runner=lambda r: FaultInjectingRunner(r, self.runner_faults))
        self.h.core.speculator.proposer = FaultInjectingProposer(self.h.drafter, self.proposer_faults)
        fail_after_outputs(self.h.core, self.output_faults)
        self.checker = TransactionChecker(self.h.core)
        self.twin = Harness(config, SPEC, seed=seed)
        for _ in range(n):
            self._add(data)

    @property
    def cfg(self) -> SchedulerConfig:
        return self.h.config

    @property
    def poisoned(self) -> set[str]:
        return self.runner_faults.poisoned | self.proposer_faults.poisoned | self.output_faults.poisoned

    def _plan(self, where: str) -> FaultPlan:
        return {"proposer": self.proposer_faults, "outputs": self.output_faults}.get(where, self.runner_faults)

    def alive(self) -> bool:
        return self.h is not None and not self.dead

    # ---- requests
    @precondition(alive)
    @rule(data=st.data())
    def add_request(self, data) -> None:
        self._add(data)

    def _add(self, data) -> None:
        spec = data.draw(request_specs(SPEC.vocab_size, self.cfg.max_model_len // 2))
        prompt = (PREFIXES.get(spec["shared_prefix"], []) + spec["prompt"])[: self.cfg.max_model_len]
        if self.h.submitted and data.draw(st.integers(0, 3)) == 0:  # an exact repeat: full prefix hits
            earlier = data.draw(st.sampled_from(sorted(self.h.submitted)))
            prompt = list(self.h.submitted[earlier].prompt_token_ids)
        rid = f"r{self.counter}"
        self.counter += 1
        kw = dict(max_tokens=spec["max_tokens"], min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
                  priority=spec["priority"], ignore_eos=spec["ignore_eos"],
                  stop_token_ids=frozenset(spec["stop_token_ids"]))
        need = -(-min(len(prompt) + kw["max_tokens"] + self.cfg.num_lookahead_tokens, self.cfg.max_model_len)
                 // self.cfg.block_size)
        if need > self.cfg.num_blocks:
            self._expect_rejected(lambda h: h.make_request(rid, prompt, **kw))
            return
        for h in (self.h, self.twin):
            h.add(h.make_request(rid, prompt, **kw))

    @precondition(alive)
    @rule(kind=st.sampled_from(["empty", "too_long", "duplicate", "max_tokens"]))
    def add_bad_request(self, kind: str) -> None:
        if kind == "duplicate":
            if not self.h.scheduler.requests:
                return
            rid = next(iter(self.h.scheduler.requests))
            self._expect_rejected(lambda h: h.make_request(rid, [1, 2, 3]), twin=False)
        elif kind == "empty":
            self._expect_rejected(lambda h: h.make_request("bad-empty", []))
        elif kind == "too_long":
            self._expect_rejected(lambda h: h.make_request("bad-long", [1] * (self.cfg.max_model_len + 1)))
        else:
            self._expect_rejected(lambda h: h.make_request("bad-max", [1, 2], max_tokens=0))

    def _expect_rejected(self, make, twin: bool = True) -> None:
        for h in (self.h, self.twin) if twin else (self.h,):
            sched = h.scheduler
            before = (len(sched.requests), len(sched.waiting), len(sched.running), sched.kv.num_free_blocks)
            request = make(h)
            try:
                h.core.add_request(request)
            except ValueError:
                pass
            else:
                raise AssertionError(f"bad request {request.request_id!r} was accepted")
            assert before == (len(sched.requests), len(sched.waiting), len(sched.running), sched.kv.num_free_blocks)
            sched.check_integrity()

    @precondition(lambda self: self.alive() and self.h.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.h.scheduler.requests)))
        self.h.abort(rid)
        self.twin.abort(rid)
        self.h.scheduler.check_integrity()

    @precondition(alive)
    @rule()
    def abort_unknown(self) -> None:
        self.h.abort("no-such-request")

    # ---- steps and faults
    @precondition(alive)
    @rule(k=st.sampled_from([0, 0, 1, 2, 4, 7]), p_correct=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    def step(self, k: int, p_correct: float) -> None:
        self._engine_may_die(lambda: self.h.step(k, p_correct))
        self.twin.step(k, p_correct)

    @precondition(lambda self: self.alive() and self.h.scheduler.requests)
    @rule(n=st.integers(2, 8), k=st.sampled_from([0, 1, 2, 4, 7]), p_correct=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    def step_a_while(self, n: int, k: int, p_correct: float) -> None:
        """Several steps in one rule: programs spend their budget stepping (where preemption,
        eviction, prefix hits and late faults happen), not choosing the next rule."""
        for _ in range(n):
            if self.dead:
                return
            self.step(k, p_correct)

    def _engine_may_die(self, run) -> None:
        """Run ``run``; the engine may die only as the EngineCore promises: when every request
        of a step (two or more) failed alone, or after ``max_failed_steps`` steps in a row in which
        nothing ran; here only requests tied to faults can fail alone (the retry absorbs the
        transient ones)."""
        try:
            run()
        except EngineDeadError as dead:
            core = self.h.core
            if dead.failed_alone:  # every request of a step failed alone: all must be tied to faults
                assert set(dead.failed_alone) <= self.poisoned, f"died blaming {dead.failed_alone}"
            else:
                assert core.failed_steps_in_a_row >= core.max_failed_steps, "the engine died too early"
            self._check_dead()

    @precondition(alive)
    @rule(where=st.sampled_from(["runner", "runner_late", "proposer", "outputs"]))
    def transient_fault(self, where: str) -> None:
        """The next attempt fails: the step's retry absorbs it. (A fault that outlives the retry
        is indistinguishable from one tied to the requests isolation tries next.)"""
        plan = self._plan(where)
        plan.late = where == "runner_late"
        for p in (self.runner_faults, self.proposer_faults, self.output_faults):
            p.transient = 1 if p is plan else 0  # one one-shot fault at a time
        self.runner_faults.malformed = False

    @precondition(lambda self: self.alive() and self.h.scheduler.requests)
    @rule(data=st.data(), where=st.sampled_from(["runner", "runner_late", "proposer", "outputs"]))
    def poison_a_request(self, data, where: str) -> None:
        rid = data.draw(st.sampled_from(sorted(self.h.scheduler.requests)))
        plan = self._plan(where)
        plan.late = where == "runner_late"
        plan.poisoned.add(rid)

    @precondition(alive)
    @rule()
    def malformed_output(self) -> None:
        self.runner_faults.malformed = True  # a one-shot fault: the only one pending
        self.runner_faults.transient = self.proposer_faults.transient = self.output_faults.transient = 0

    @precondition(lambda self: self.alive() and self.h.scheduler.requests)
    @rule(data=st.data())
    def engine_wide_fault(self, data) -> None:
        if data.draw(st.integers(0, 5)):  # rare: it ends the run
            return
        self.runner_faults.engine_wide = True
        self.victims = set(self.h.scheduler.requests)  # end with errors until the engine gives up
        try:  # each step can only fail; within max_failed_steps of them the engine must give up
            for i in range(2 * self.h.core.max_failed_steps + 2):
                if not self.h.scheduler.requests:
                    self.h.add(self.h.make_request(f"doomed{i}", [1, 2, 3], max_tokens=2))
                    self.victims.add(f"doomed{i}")
                self.h.step()
        except EngineDeadError:
            pass
        else:
            raise AssertionError("an engine-wide fault did not kill the engine")
        self._check_dead()

    def _check_dead(self) -> None:
        self.dead = True
        core = self.h.core
        assert not core.is_healthy() and not self.h.scheduler.requests
        kv = self.h.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks, "a dead engine still holds KV blocks"
        self.dead_engine_refuses()

    @precondition(lambda self: self.dead)
    @rule()
    def dead_engine_refuses(self) -> None:
        core = self.h.core
        for call in (core.step, lambda: core.add_request(self.h.make_request("late", [1, 2]))):
            try:
                call()
            except EngineDeadError:
                continue
            raise AssertionError("a dead engine accepted a call")
        assert core.abort_request("no-such-request") is None

    # ---- checks
    @invariant()
    def tables_hold_only_requests_in_flight(self) -> None:
        if self.h is not None:
            check_tables(self.h.core)
            check_tables(self.twin.core)

    @invariant()
    def matches_its_twin(self) -> None:
        if self.h is None:
            return
        self.h.check_lossless()
        self.twin.check_lossless()
        for rid, reason in self.h.finished.items():
            if reason == "error":
                assert rid in self.poisoned | self.victims, f"{rid} ended with an error without a fault of its own"
            elif reason != "abort" and self.twin.finished.get(rid) not in (None, "abort"):
                assert self.h.outputs[rid] == self.twin.outputs[rid], f"{rid}: output differs from the twin"

    def events(self) -> dict[str, int]:
        """What this program reached so far (``testing.coverage.EVENTS``)."""
        h, stats = self.h, self.h.core.speculator.stats
        return {"stepped": h.num_busy_steps, "preempted": h.scheduler.num_preemptions,
                "prefix_hit": h.scheduler.kv.prefix_hits, "evicted": h.scheduler.kv.pool.num_evictions,
                "rejected_draft": stats.num_draft_tokens - stats.num_accepted_tokens,
                "late_fault": self.checker.num_dirty, "late_fault_evicted": self.checker.num_dirty_evictions,
                "request_fault": sum(1 for reason in h.finished.values() if reason == "error")}

    def teardown(self) -> None:
        if self.h is None:
            return
        events = self.events()
        for name in ("stepped", "preempted", "prefix_hit", "evicted", "late_fault_evicted", "rejected_draft"):
            target(float(min(events[name], 20)), label=name)  # steer generation towards the rare events
        if self.coverage is not None:
            self.coverage.record(events)
        if not self.dead:
            self._engine_may_die(lambda: self.h.run_until_done(k=2, p_correct=0.7, max_steps=20_000))
        self.twin.run_until_done(k=2, p_correct=0.7, max_steps=20_000)
        self.matches_its_twin()
        for rid in self.h.submitted:
            if self.dead or self.h.finished.get(rid) == "abort" or self.twin.finished.get(rid) == "abort":
                continue
            if rid in self.poisoned and self.h.finished.get(rid) == "error":
                continue
            assert self.h.finished.get(rid) == self.twin.finished.get(rid), f"{rid} finished differently"
            assert self.h.outputs[rid] == self.twin.outputs[rid], f"{rid}: output differs from the twin"
        for h in (self.h, self.twin):
            kv = h.scheduler.kv
            assert kv.num_free_blocks == kv.num_blocks, "blocks leaked after every request finished"


def machine_for(config: SchedulerConfig | None, coverage: EventCoverage | None = None) -> type[SchedulerMachine]:
    """A SchedulerMachine subclass pinned to one configuration (None: random configurations),
    recording the events its programs reach into ``coverage``."""
    return type("PinnedSchedulerMachine", (SchedulerMachine,), {"fixed_config": config, "coverage": coverage})
