"""One scheduler + fake model + fake drafter, stepped with checks after every operation.

Shared by the state machine, the losslessness property and the soak test, so all three drive
the engine loop exactly the way ``LLMEngine.step`` does.
"""

from __future__ import annotations

import random

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.request import Request
from tokenbudget.scheduler.scheduler import Scheduler
from tokenbudget.scheduler.testing.fake_model import (
    FakeDrafter,
    FakeModelRunner,
    FakeModelSpec,
    reference_generate,
)


class Harness:
    def __init__(self, config: SchedulerConfig, spec: FakeModelSpec | None = None, seed: int = 0,
                 check: bool = True) -> None:
        self.config = config
        self.spec = spec or FakeModelSpec()
        self.scheduler = Scheduler(config)
        self.runner = FakeModelRunner(self.spec, config.num_blocks, config.block_size)
        self.drafter = FakeDrafter(self.spec, random.Random(seed))
        self.check = check
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}  # request_id -> finish reason
        self.submitted: dict[str, Request] = {}
        self.acceptance_by_pos: list[int] = []
        self.num_steps = 0

    def make_request(self, rid: str, prompt: list[int], **kw) -> Request:
        return Request(rid, list(prompt), eos_token_id=self.spec.eos_token_id, **kw)

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.submitted[request.request_id] = request
        self.outputs[request.request_id] = []

    def abort(self, rid: str) -> None:
        self.scheduler.abort_requests([rid])
        if rid in self.outputs and rid not in self.finished:
            self.finished[rid] = "abort"
        self.drafter.forget(rid)

    def step(self, k: int = 0, p_correct: float = 0.5) -> None:
        sched = self.scheduler
        if k:
            decoding = [r for r in sched.running if r.num_computed_tokens == r.num_tokens - 1]
            sched.update_draft_token_ids(self.drafter.propose(decoding, k, p_correct))
            if self.check:
                sched.check_integrity()
        drafts_before = {r.request_id: list(r.spec_token_ids) for r in sched.running}
        out = sched.schedule()
        if self.check:
            check_schedule_output(self.config, out, drafts_before)
            sched.check_integrity()
        result = self.runner.execute(out)
        for o in sched.update_from_output(out, result):
            self.outputs[o.request_id].extend(o.new_token_ids)
            self._record_acceptance(o.num_draft_tokens, o.num_accepted_tokens)
            if o.finished:
                self.finished[o.request_id] = o.finish_reason
                self.drafter.forget(o.request_id)
        self.num_steps += 1
        if self.check:
            sched.check_integrity()
            assert_monotone(self.acceptance_by_pos)

    def _record_acceptance(self, drafted: int, accepted: int) -> None:
        per_pos = self.acceptance_by_pos
        if len(per_pos) < drafted:
            per_pos.extend([0] * (drafted - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1

    def run_until_done(self, k: int = 0, p_correct: float = 0.5, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step(k, p_correct)
        raise AssertionError(f"requests still unfinished after {max_steps} steps (starvation?)")

    def expected(self, rid: str) -> list[int]:
        return reference_generate(self.spec, self.submitted[rid], self.config.max_model_len)

    def check_lossless(self) -> None:
        """Invariant 8: every finished (not aborted) request's stream equals the solo reference."""
        for rid, reason in self.finished.items():
            if reason == "abort":
                continue
            assert self.outputs[rid] == self.expected(rid), f"{rid}: output differs from solo greedy run"


def check_schedule_output(config: SchedulerConfig, out, drafts_before: dict[str, list[int]]) -> None:
    """Invariants 1 and 2 on one SchedulerOutput."""
    total = sum(sr.num_tokens for sr in out.scheduled)
    assert total == out.total_num_scheduled_tokens
    assert total <= config.max_num_batched_tokens, "token budget exceeded"
    ids = [sr.request_id for sr in out.scheduled]
    assert len(set(ids)) == len(ids), "a request scheduled twice"
    assert len(ids) <= config.max_num_seqs
    for sr in out.scheduled:
        assert sr.num_tokens >= 1, "scheduled zero tokens"
        assert len(sr.token_ids) == sr.num_tokens
        drafts = drafts_before.get(sr.request_id, [])
        assert len(sr.spec_token_ids) <= len(drafts), "more drafts scheduled than proposed"
        assert sr.spec_token_ids == drafts[:len(sr.spec_token_ids)], "scheduled drafts are not a prefix"
        assert sr.num_computed_tokens + sr.num_tokens <= config.max_model_len, "scheduled past max_model_len"
        if sr.is_new:  # invariant 5: a prefix-cache hit never covers the last committed token
            assert sr.num_computed_tokens <= sr.request.num_tokens - 1, "cache hit covers the whole prompt"
    if out.preempted_request_ids:
        assert not any(sr.is_new for sr in out.scheduled), "a waiting request was admitted in a step that preempted"


def assert_monotone(per_pos: list[int]) -> None:
    """Invariant 7: accepted counts never increase with draft position."""
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), f"acceptance by position not monotone: {per_pos}"
