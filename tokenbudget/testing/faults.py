"""Faults on demand, for testing the step transaction (``engine.core.engine_core``).

``FaultPlan`` says what fails; ``FaultInjectingRunner`` and ``FaultInjectingProposer`` wrap a
runner or a proposer, and ``fail_after_outputs`` the output processor of an engine core, and raise
``InjectedFault`` (or ``KeyboardInterrupt``) accordingly:

* ``transient``: the next N attempts that reach this point fail once each (a retry passes);
* ``poisoned``: request ids whose presence in a batch makes it fail (request-attributable);
* ``engine_wide``: every attempt fails (nothing a request does can make it pass);
* ``interrupt``: the next attempt raises KeyboardInterrupt (Ctrl-C inside a step).

A runner fault fires either before the forward (``late=False``) or after it has written its KV
(``late=True``), so rollbacks after a forward pass, which must not trust the written blocks, are
exercised too; ``malformed=True`` returns a broken output instead of raising (the scheduler's
validation in ``plan_update`` must catch it). An output-processor fault fires after the last stage
before the commit has changed its state (every table of the step written).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenbudget.scheduler.output import ModelRunnerOutput, SchedulerOutput


class InjectedFault(RuntimeError):
    """A fault a test injected."""


@dataclass
class FaultPlan:
    transient: int = 0
    poisoned: set[str] = field(default_factory=set)
    engine_wide: bool = False
    interrupt: bool = False
    late: bool = False
    malformed: bool = False
    num_fired: int = 0

    def check(self, request_ids: set[str], where: str) -> None:
        """Raise if the plan says a batch of these requests fails here."""
        if not request_ids:
            return
        if self.interrupt:
            self.interrupt = False
            self.num_fired += 1
            raise KeyboardInterrupt(f"injected interrupt in {where}")
        if self.engine_wide:
            self.num_fired += 1
            raise InjectedFault(f"engine-wide fault in {where}")
        if self.transient > 0:
            self.transient -= 1
            self.num_fired += 1
            raise InjectedFault(f"transient fault in {where}")
        bad = request_ids & self.poisoned
        if bad:
            self.num_fired += 1
            raise InjectedFault(f"fault in {where} caused by {sorted(bad)}")


class FaultInjectingRunner:
    """A runner whose ``execute`` fails as ``plan`` says; otherwise ``inner.execute``."""

    def __init__(self, inner, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        ids = {sr.request_id for sr in sched.scheduled}
        if not self.plan.late:
            self.plan.check(ids, "the runner")
        out = self.inner.execute(sched)
        if self.plan.late:
            self.plan.check(ids, "the runner (after its forward)")
        if self.plan.malformed and ids:
            self.plan.malformed = False
            self.plan.num_fired += 1
            out = ModelRunnerOutput(out.req_ids, [toks + toks + [0] for toks in out.sampled_token_ids])
        return out


class FaultInjectingProposer:
    """A proposer whose ``propose`` fails as ``plan`` says; otherwise ``inner.propose``."""

    def __init__(self, inner, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, requests, num_tokens):
        self.plan.check({r.request_id for r in requests}, "the proposer")
        return self.inner.propose(requests, num_tokens)


def fail_after_outputs(core, plan: FaultPlan) -> None:
    """Make ``core``'s output processor fail as ``plan`` says, after its ``prepare`` ran."""
    outputs = core.outputs
    prepare = outputs.prepare

    def failing(step_plan, *args):
        out = prepare(step_plan, *args)
        plan.check({entry.request_id for entry in step_plan}, "the output processor (after it ran)")
        return out

    outputs.prepare = failing
