"""EngineCore: the only step loop, and each step a transaction.

``LLMEngine``, ``AsyncLLM``, ``LLM``, the benches' synthetic engine and the scheduler fuzzer all
drive this one object; what differs between them (a real or a fake runner, a tokenizer or none)
is what they pass in. One step:

    drafts = speculator.propose(scheduler)            # drafts (+ probabilities) for decoding requests
    drafts = structured.trim_drafts(drafts)           #   cut at the first token a grammar forbids
    scheduler.add_drafts(drafts)                      #   cut to draft_limit
    sched  = scheduler.schedule()                     # token budget; counters advance optimistically
    result = runner.execute(sched)                    # one forward + (grammar masks) + sampling/verification
    plan   = scheduler.plan_update(sched, result)     # what the step commits; changes nothing
    structured.prepare(plan)                          # grammars consume the tokens (may end requests)
    outs   = outputs.prepare(plan)                    # text, stop strings (may end requests)
    --- commit: scheduler.apply_update, outputs.commit, structured.commit, speculator.commit,
        on_finished fan-out

Everything before the commit either changes nothing or journals its changes, so when anything
there raises (model, sampler, proposer, a kernel, the detokenizer) the step is rolled back:
counters, blocks, prefix-cache entries, drafts, proposer/controller, grammar and output state are
as they were (``kv_cache.journal`` says what a rollback after a forward pass keeps for safety). Then:

* the step is retried once: a *transient* fault passes and the outputs are those of a
  fault-free run (a request's tokens depend only on its own history, ``keyed_random``);
* if the retry fails too, the requests of the failed step are split in halves, each half stepped
  alone (twice), recursively, down to the requests whose presence makes a step fail: those
  finish with ``finish_reason="error"`` and the fault in ``RequestOutput.error``; the others go
  on, their output the same as in a fault-free run;
* *engine-wide* faults (every suspect fails alone, or ``max_consecutive_failures`` failed
  attempts in a row): the engine is dead; every later call raises ``EngineDeadError``, and every
  request is released.

The commit cannot fail by design (no I/O, no model code); if it does anyway, the state may be
half committed and the engine declares itself dead rather than serve from it. ``KeyboardInterrupt``
and ``CancelledError`` roll the step back and propagate; SIGINT is held during the sections that
change state (``interrupts.deferred_sigint``).

One fan-out, ``_release(request)``, frees what a finished or aborted request held anywhere
outside the scheduler (proposer indexes, controller, grammar and output state); the scheduler frees its KV
blocks when it finishes the request.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from tokenbudget.engine.api.errors import EngineDeadError
from tokenbudget.engine.api.outputs import RequestOutput
from tokenbudget.engine.core.interrupts import deferred_sigint
from tokenbudget.engine.core.output_processor import OutputProcessor
from tokenbudget.engine.structured.manager import StructuredOutputs
from tokenbudget.scheduler.output import EngineCoreOutput, SchedulerOutput
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.scheduler import Scheduler
from tokenbudget.spec.speculator import Speculator

logger = logging.getLogger("tokenbudget")


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner, speculator: Speculator | None = None,
                 output_processor: OutputProcessor | None = None, *, max_consecutive_failures: int = 8,
                 structured: StructuredOutputs | None = None) -> None:
        if max_consecutive_failures < 2:
            raise ValueError(f"max_consecutive_failures must be >= 2, got {max_consecutive_failures}")
        self.scheduler = scheduler
        self.runner = runner
        self.speculator = speculator if speculator is not None else Speculator()
        self.outputs = output_processor if output_processor is not None else OutputProcessor(None)
        self.structured = structured if structured is not None else StructuredOutputs(None)
        self.max_consecutive_failures = max_consecutive_failures
        self.dead: EngineDeadError | None = None
        self.num_failed_attempts = 0
        self.num_errored_requests = 0
        self._consecutive_failures = 0
        self._participants: set[str] = set()

    # ------------------------------------------------------------------ requests (between steps)
    def add_request(self, request: Request, prompt: str | None = None) -> None:
        """Queue a request; ValueError (changing nothing) for a bad one."""
        self.raise_if_dead()
        matcher = self.structured.compile(request)
        self.scheduler.add_request(request)
        try:
            self.outputs.add_request(request, prompt)
        except BaseException:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
            raise
        self.structured.add(request.request_id, matcher)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a running or waiting request; its final output (``finish_reason="abort"``), or
        None for an id that is not in flight."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return None if request is None else self._finish(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def is_healthy(self) -> bool:
        return self.dead is None

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs it produced (errored requests' final outputs included)."""
        self.raise_if_dead()
        if not self.scheduler.has_unfinished_requests():
            return []
        try:
            return self._try(None)
        except EngineDeadError:
            raise
        except Exception:
            return self._recover()

    def _attempt(self, only: Collection[str] | None) -> list[RequestOutput]:
        scheduler, speculator, outputs, structured = self.scheduler, self.speculator, self.outputs, self.structured
        participants = self._participants = set()
        if speculator.enabled:
            participants.update(r.request_id for r in scheduler.decoding_requests(only))
        dirty = False
        scheduler.begin_step()
        try:
            drafts = speculator.propose(scheduler, only)
            with deferred_sigint():
                if drafts is not None:
                    scheduler.add_drafts(structured.trim_drafts(drafts))
                sched = scheduler.schedule(only)
            participants.update(sr.request_id for sr in sched.scheduled)
            dirty = True
            result = self.runner.execute(sched)
            plan = scheduler.plan_update(sched, result)
            structured.prepare(plan)
            step_outputs = outputs.prepare(plan)
        except BaseException:
            with deferred_sigint():
                outputs.rollback()
                structured.rollback()
                speculator.rollback()
                scheduler.rollback_step(dirty)
            raise
        with deferred_sigint():
            self._commit(sched, plan)
        return step_outputs

    def _commit(self, sched: SchedulerOutput, plan: list[EngineCoreOutput]) -> None:
        try:
            finished = self.scheduler.apply_update(sched, plan)
            self.outputs.commit()
            self.structured.commit(plan)
            last = getattr(self.runner, "last_step", None)
            self.speculator.commit(plan, sched.total_num_scheduled_tokens, last[1] if last else None,
                                   len(sched.scheduled))
            for request in finished:
                self._release(request)
        except BaseException as exc:  # a bug: the state may be half committed
            self._die(exc)

    # ------------------------------------------------------------------ faults
    def _try(self, only: Collection[str] | None) -> list[RequestOutput]:
        """One attempt, counting failures; the engine dies after too many in a row."""
        try:
            outputs = self._attempt(only)
        except Exception as fault:
            self.num_failed_attempts += 1
            self._consecutive_failures += 1
            logger.warning("tokenbudget: step failed (%s: %s); %d failure(s) in a row", type(fault).__name__,
                           fault, self._consecutive_failures)
            if self._consecutive_failures >= self.max_consecutive_failures:
                self._die(fault)
            raise
        if self._participants:  # an attempt that ran nothing proves nothing
            self._consecutive_failures = 0
        return outputs

    def _try_twice(self, only: Collection[str]) -> list[RequestOutput]:
        try:
            return self._try(only)
        except EngineDeadError:
            raise
        except Exception:
            return self._try(only)

    def _recover(self) -> list[RequestOutput]:
        """The step failed once: retry it, then isolate the requests that make it fail."""
        suspects = sorted(self._participants) or sorted(self.scheduler.requests)
        try:
            return self._try(None)  # transient faults pass here
        except EngineDeadError:
            raise
        except Exception as fault:
            last_fault = fault
        outputs: list[RequestOutput] = []
        failed_alone: list[tuple[str, Exception]] = []
        self._isolate(suspects, last_fault, outputs, failed_alone)
        if len(failed_alone) >= 2 and len(failed_alone) == len(suspects):
            self._die(failed_alone[-1][1])  # every request fails alone: the fault is not theirs
        for request_id, fault in failed_alone:
            out = self._fail_request(request_id, fault)
            if out is not None:
                outputs.append(out)
        return outputs

    def _isolate(self, group: list[str], fault: Exception, outputs: list[RequestOutput],
                 failed_alone: list[tuple[str, Exception]]) -> None:
        """``group`` failed (twice) together: step each half alone, recursively."""
        if len(group) == 1:
            failed_alone.append((group[0], fault))
            return
        half = len(group) // 2
        for part in (group[:half], group[half:]):
            part = [rid for rid in part if rid in self.scheduler.requests]
            if not part:
                continue
            try:
                outputs.extend(self._try_twice(part))
            except EngineDeadError:
                raise
            except Exception as part_fault:
                self._isolate(part, part_fault, outputs, failed_alone)

    def _fail_request(self, request_id: str, fault: Exception) -> RequestOutput | None:
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        if request is None:
            return None
        self.num_errored_requests += 1
        logger.warning("tokenbudget: request %r failed alone and was ended: %s: %s", request_id,
                       type(fault).__name__, fault)
        return self._finish(request, f"{type(fault).__name__}: {fault}")

    def _die(self, fault: BaseException) -> None:
        dead = EngineDeadError(f"the engine stopped serving after {type(fault).__name__}: {fault}")
        dead.__cause__ = fault
        self.dead = dead
        logger.error("tokenbudget: %s", dead)
        try:  # release everything, so a dead engine holds no KV blocks
            for rid in list(self.scheduler.requests):
                self._release(self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR))
        except Exception:  # the state was already inconsistent: keep what is released
            logger.exception("tokenbudget: releasing requests of a dead engine failed")
        raise dead

    def raise_if_dead(self) -> None:
        """``EngineDeadError`` (caused by the fault that killed it) once the engine is dead."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead)) from self.dead.__cause__

    # ------------------------------------------------------------------ the one fan-out
    def _finish(self, request: Request, error: str | None = None) -> RequestOutput | None:
        """Final output of a request ended between steps, then release it."""
        out = self.outputs.final_output(request, error)
        self._release(request)
        return out

    def _release(self, request: Request) -> None:
        self.speculator.on_finished(request)
        self.outputs.on_finished(request)
        self.structured.on_finished(request)
