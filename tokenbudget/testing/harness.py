"""The real ``EngineCore`` around a fake model and a fake drafter, with checks after every step.

Shared by the state machine, the losslessness property, the soak test and the scheduler unit
tests, so all of them drive the very step loop the engine runs (``engine.core.engine_core``):
only the runner (``FakeModelRunner``, optionally wrapped by a fault injector) and the proposer
(``FakeDrafter``) are stand-ins. Outputs arrive as DELTA ``RequestOutput``s and are collected per
request.
"""

from __future__ import annotations

import random

from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams
from tokenbudget.api.spec_config import SpeculativeConfig
from tokenbudget.engine.core.engine_core import EngineCore
from tokenbudget.engine.core.output_processor import OutputProcessor
from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.output import SchedulerOutput
from tokenbudget.scheduler.request import Request
from tokenbudget.scheduler.scheduler import Scheduler
from tokenbudget.spec.speculator import Speculator
from tokenbudget.testing.fake_model import FakeDrafter, FakeModelRunner, FakeModelSpec, reference_generate

DELTA_PARAMS = SamplingParams(output_kind=RequestOutputKind.DELTA)
MAX_DRAFTS = 16  # the speculator's cap; the fake drafter proposes its own k (<= this) per step


class CheckingRunner:
    """Checks invariants 1 and 2 (and integrity mid-step) on every batch, then runs ``inner``."""

    def __init__(self, inner, scheduler: Scheduler, check: bool) -> None:
        self.inner, self.scheduler, self.check = inner, scheduler, check
        self.last_sched: SchedulerOutput | None = None

    def execute(self, sched: SchedulerOutput):
        self.last_sched = sched
        if self.check:
            running = self.scheduler.running
            check_schedule_output(self.scheduler.config, sched, {r.request_id: r.spec_token_ids for r in running},
                                  {r.request_id: r.num_tokens for r in running})
            self.scheduler.check_integrity()
        return self.inner.execute(sched)


class Harness:
    def __init__(self, config: SchedulerConfig, spec: FakeModelSpec | None = None, seed: int = 0,
                 check: bool = True, wrap_runner=None) -> None:
        self.config = config
        self.spec = spec or FakeModelSpec()
        self.scheduler = Scheduler(config)
        self.model = FakeModelRunner(self.spec, config.num_blocks, config.block_size)
        inner = wrap_runner(self.model) if wrap_runner is not None else self.model
        self.runner = CheckingRunner(inner, self.scheduler, check)
        self.drafter = FakeDrafter(self.spec, random.Random(seed))
        speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=MAX_DRAFTS), self.drafter)
        self.core = EngineCore(self.scheduler, self.runner, speculator, OutputProcessor(None))
        self.check = check
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}  # request_id -> finish reason
        self.errors: dict[str, str] = {}  # request_id -> the fault that ended it
        self.submitted: dict[str, Request] = {}
        self.num_steps = 0
        self.num_busy_steps = 0  # steps that scheduled at least one request

    def make_request(self, rid: str, prompt: list[int], **kw) -> Request:
        return Request(rid, list(prompt), eos_token_id=self.spec.eos_token_id, sampling_params=DELTA_PARAMS, **kw)

    def add(self, request: Request) -> None:
        self.core.add_request(request)
        self.submitted[request.request_id] = request
        self.outputs[request.request_id] = []

    def abort(self, rid: str) -> None:
        if self.core.abort_request(rid) is not None:
            self.finished[rid] = "abort"

    def step(self, k: int = 0, p_correct: float = 0.5, drafts: dict[str, list[int]] | None = None
             ) -> SchedulerOutput | None:
        """One engine step with drafts of length ``k`` (right with probability ``p_correct``) or
        exactly ``drafts``; returns the last batch the runner saw."""
        self.drafter.k, self.drafter.p_correct, self.drafter.forced = k, p_correct, dict(drafts or {})
        self.runner.last_sched = None
        for out in self.core.step():
            self._collect(out)
        self.num_steps += 1
        self.num_busy_steps += self.runner.last_sched is not None and not self.runner.last_sched.is_empty
        if self.check:
            self.scheduler.check_integrity()
            assert_monotone(self.core.speculator.stats.accepted_per_pos)
        return self.runner.last_sched

    def _collect(self, out) -> None:
        c = out.outputs[0]
        self.outputs[out.request_id].extend(c.token_ids)
        if out.finished:
            self.finished[out.request_id] = c.finish_reason
            if out.error is not None:
                self.errors[out.request_id] = out.error

    def run_until_done(self, k: int = 0, p_correct: float = 0.5, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step(k, p_correct)
        raise AssertionError(f"requests still unfinished after {max_steps} steps (starvation?)")

    def expected(self, rid: str) -> list[int]:
        return reference_generate(self.spec, self.submitted[rid], self.config.max_model_len)

    def check_lossless(self) -> None:
        """Invariant 8: every request that finished normally streamed exactly its solo run."""
        for rid, reason in self.finished.items():
            if reason in ("abort", "error"):
                continue
            assert self.outputs[rid] == self.expected(rid), f"{rid}: output differs from solo greedy run"


def check_schedule_output(config: SchedulerConfig, out: SchedulerOutput, drafts_before: dict[str, list[int]],
                          num_committed: dict[str, int]) -> None:
    """Invariants 1 and 2 (and 5's cache-hit half) on one SchedulerOutput; ``drafts_before`` and
    ``num_committed``: each running request's drafts and committed token count at schedule time."""
    total = sum(sr.num_tokens for sr in out.scheduled)
    assert total == out.total_num_scheduled_tokens
    assert total <= config.max_num_batched_tokens, "token budget exceeded"
    ids = [sr.request_id for sr in out.scheduled]
    assert len(set(ids)) == len(ids), "a request scheduled twice"
    assert len(ids) <= config.max_num_seqs
    for sr in out.scheduled:
        assert sr.num_tokens >= 1, "scheduled zero tokens"
        drafts = drafts_before.get(sr.request_id, [])
        assert len(sr.spec_token_ids) <= len(drafts), "more drafts scheduled than proposed"
        assert sr.spec_token_ids == drafts[:len(sr.spec_token_ids)], "scheduled drafts are not a prefix"
        assert sr.num_computed_tokens + sr.num_tokens <= config.max_model_len, "scheduled past max_model_len"
        if sr.is_new:  # invariant 5: a prefix-cache hit never covers the last committed token
            assert sr.num_computed_tokens <= num_committed[sr.request_id] - 1, "cache hit covers the whole prompt"
    if out.preempted_request_ids:
        assert not any(sr.is_new for sr in out.scheduled), "a waiting request was admitted in a step that preempted"


def assert_monotone(per_pos: list[int]) -> None:
    """Invariant 7: accepted counts never increase with draft position."""
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), f"acceptance by position not monotone: {per_pos}"
