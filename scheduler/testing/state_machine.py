"""A Hypothesis state machine over scheduler + KV cache + fake model + fake drafter.

Rules add requests (random prompts, shared prefixes, priorities, limits), add bad ones (which
must raise ValueError and change nothing), abort, and step with random drafts and acceptance.
Every step checks DESIGN.md invariants 1-7; every finished request is checked against its solo
run (invariant 8); at teardown everything is drained and every block must be free.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.testing.fake_model import FakeModelSpec
from tokenbudget.scheduler.testing.harness import Harness
from tokenbudget.scheduler.testing.strategies import request_specs, scheduler_configs

SPEC = FakeModelSpec()
PREFIXES = {1: [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49], 2: [7, 7, 7, 7, 3, 3, 3, 3, 11, 2]}


class SchedulerMachine(RuleBasedStateMachine):
    """Set ``fixed_config`` (a SchedulerConfig) on a subclass to fuzz one configuration."""

    fixed_config: SchedulerConfig | None = None

    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.counter = 0

    @initialize(config=scheduler_configs(), seed=st.integers(0, 2**16))
    def setup(self, config: SchedulerConfig, seed: int) -> None:
        self.h = Harness(self.fixed_config or config, SPEC, seed=seed)

    @property
    def cfg(self) -> SchedulerConfig:
        return self.h.config

    @rule(data=st.data())
    def add_request(self, data) -> None:
        spec = data.draw(request_specs(SPEC.vocab_size, self.cfg.max_model_len // 2))
        prompt = (PREFIXES.get(spec["shared_prefix"], []) + spec["prompt"])[: self.cfg.max_model_len]
        if self.h.submitted and data.draw(st.integers(0, 3)) == 0:  # an exact repeat: full prefix hits
            earlier = data.draw(st.sampled_from(sorted(self.h.submitted)))
            prompt = list(self.h.submitted[earlier].prompt_token_ids)
        rid = f"r{self.counter}"
        self.counter += 1
        request = self.h.make_request(rid, prompt, max_tokens=spec["max_tokens"], min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
                                      priority=spec["priority"], ignore_eos=spec["ignore_eos"],
                                      stop_token_ids=frozenset(spec["stop_token_ids"]))
        need = -(-min(len(prompt) + request.max_tokens + self.cfg.num_lookahead_tokens, self.cfg.max_model_len) // self.cfg.block_size)
        if need > self.cfg.num_blocks:
            self._expect_rejected(request)
            return
        self.h.add(request)

    @rule(kind=st.sampled_from(["empty", "too_long", "duplicate", "max_tokens"]))
    def add_bad_request(self, kind: str) -> None:
        if kind == "duplicate":
            if not self.h.scheduler.requests:
                return
            rid = next(iter(self.h.scheduler.requests))
            request = self.h.make_request(rid, [1, 2, 3])
        elif kind == "empty":
            request = self.h.make_request("bad-empty", [])
        elif kind == "too_long":
            request = self.h.make_request("bad-long", [1] * (self.cfg.max_model_len + 1))
        else:
            request = self.h.make_request("bad-max", [1, 2], max_tokens=0)
        self._expect_rejected(request)

    def _expect_rejected(self, request) -> None:
        sched = self.h.scheduler
        before = (len(sched.requests), len(sched.waiting), len(sched.running), sched.kv.num_free_blocks)
        try:
            sched.add_request(request)
        except ValueError:
            pass
        else:
            raise AssertionError(f"bad request {request.request_id!r} was accepted")
        assert before == (len(sched.requests), len(sched.waiting), len(sched.running), sched.kv.num_free_blocks)
        sched.check_integrity()

    @precondition(lambda self: self.h is not None and self.h.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.h.scheduler.requests)))
        self.h.abort(rid)
        self.h.scheduler.check_integrity()

    @rule()
    def abort_unknown(self) -> None:
        self.h.abort("no-such-request")

    @rule(k=st.sampled_from([0, 0, 1, 2, 4, 7]), p_correct=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    def step(self, k: int, p_correct: float) -> None:
        self.h.step(k, p_correct)

    @invariant()
    def lossless_so_far(self) -> None:
        if self.h is not None:
            self.h.check_lossless()

    def teardown(self) -> None:
        if self.h is None:
            return
        self.h.run_until_done(k=2, p_correct=0.7, max_steps=20_000)
        self.h.check_lossless()
        kv = self.h.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks, "blocks leaked after every request finished"


def machine_for(config: SchedulerConfig | None) -> type[SchedulerMachine]:
    """A SchedulerMachine subclass pinned to one configuration (None: random configurations)."""
    return type("PinnedSchedulerMachine", (SchedulerMachine,), {"fixed_config": config})
