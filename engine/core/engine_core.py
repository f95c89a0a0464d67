"""EngineCore: the only step loop, and each step a transaction.

``LLMEngine``, ``AsyncLLM``, ``LLM``, the benches' synthetic engine and the scheduler fuzzer all
drive this one object; what differs between them (a real or a fake runner, a tokenizer or none)
is what they pass in. One step:

    skip   = structured.plan_step(n)                  # (once a step) grammar requests past their mask share
    drafts = speculator.propose(scheduler)            # drafts (+ probabilities) for decoding requests
    drafts = structured.trim_drafts(drafts)           #   cut at the first token a grammar forbids
    scheduler.add_drafts(drafts)                      #   cut to draft_limit
    sched  = scheduler.schedule(skip=skip)            # token budget; counters advance optimistically
    sched.grammar_bitmask = structured.grammar_bitmask(sched)  # masks of the sampling rows
    result = runner.execute(sched)                    # one forward + masks applied + sampling/verification
    plan   = scheduler.plan_update(sched, result)     # what the step commits; changes nothing
    structured.prepare(plan)                          # grammars consume the tokens (may end requests)
    outs   = outputs.prepare(plan)                    # text, stop strings (may end requests)
    --- commit: scheduler.apply_update, outputs.commit, structured.commit, speculator.commit,
        on_finished fan-out

**Request faults** (``scheduler.request_fault.RequestFault``: a grammar that cannot give a mask
or exceeds its mask budget, a logits processor that raises, parameters that leave no token
allowed) name the requests they belong to. The step is rolled back, exactly those requests end
with ``finish_reason="error"`` and the step runs again without them. They are never retried,
never isolated by halving and never counted towards ``max_failed_steps``: whatever a request
asks for, it can only end itself. Every other exception is an *engine fault*, handled below.

**The grammar-mask budget** (``engine.structured.mask_budget``): the structured requests whose
share of the step's mask CPU is used up sit the step out (``skip``); a ``MaskDeferral`` (the
budget ran out while masks were made) rolls the attempt back like a request fault and runs it
again with those requests left out too. Neither ends nor blames anyone.

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
* *engine-wide* faults: every request of the failed step (two or more, not all children of one
  ``n > 1`` request) fails alone too, or
  ``max_failed_steps`` steps in a row in which nothing could run (a lone request failing alone
  each time looks exactly like a bad request; a few in a row do not): the engine is dead, every
  later call raises ``EngineDeadError``, and every request is released.

The commit cannot fail by design (no I/O, no model code); if it does anyway, the state may be
half committed and the engine declares itself dead rather than serve from it. ``KeyboardInterrupt``
and ``CancelledError`` roll the step back and propagate; SIGINT is held during the sections that
change state (``interrupts.deferred_sigint``).

One fan-out, ``_release(request)``, frees what a finished or aborted request held anywhere
outside the scheduler (proposer indexes, controller, grammar and output state); the scheduler frees its KV
blocks when it finishes the request.

A request with ``n > 1`` enters as n child requests (``engine.core.parallel_sampling``); each is
scheduled, isolated on a fault and finished on its own, and their outputs are gathered into the
parent's after the commit. Aborting the parent's id aborts every child still in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from tokenbudget.api.errors import EngineDeadError
from tokenbudget.api.outputs import RequestOutput
from tokenbudget.engine.core.interrupts import deferred_sigint
from tokenbudget.engine.core.output_processor import OutputProcessor
from tokenbudget.engine.core.parallel_sampling import ParentRequest
from tokenbudget.engine.core.stats import EngineStats, ThroughputMeter, collect_stats
from tokenbudget.engine.structured.manager import StructuredOutputs
from tokenbudget.engine.structured.mask_budget import MaskDeferral
from tokenbudget.scheduler.output import EngineCoreOutput, SchedulerOutput
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.request_fault import RequestFault, short
from tokenbudget.scheduler.scheduler import Scheduler
from tokenbudget.spec.speculator import Speculator

logger = logging.getLogger("tokenbudget")


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner, speculator: Speculator | None = None,
                 output_processor: OutputProcessor | None = None, *, max_failed_steps: int = 4,
                 structured: StructuredOutputs | None = None) -> None:
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.scheduler = scheduler
        self.runner = runner
        self.speculator = speculator if speculator is not None else Speculator()
        self.outputs = output_processor if output_processor is not None else OutputProcessor(None)
        self.structured = structured if structured is not None else StructuredOutputs(None)
        self.max_failed_steps = max_failed_steps
        self.dead: EngineDeadError | None = None
        self.num_failed_attempts = 0
        self.num_errored_requests = 0
        self.failed_steps_in_a_row = 0  # steps in which no attempt that ran something passed
        self._progress = False  # this step: an attempt that ran something passed
        self.num_prompt_tokens = 0  # of the requests accepted
        self.num_generated_tokens = 0  # output tokens committed
        self.throughput = ThroughputMeter()
        self._participants: set[str] = set()
        self._step_clock = 0.0  # perf_counter() when the current attempt began
        self._fault_outputs: list[RequestOutput] = []  # this step's requests ended by a RequestFault
        self._skip: frozenset[str] = frozenset()  # this step's structured requests waiting for mask budget

    # ------------------------------------------------------------------ requests (between steps)
    def add_request(self, request: Request, prompt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request (its n children when ``n > 1``); ValueError (changing nothing) for a
        bad one. ``arrival_time`` (``time.monotonic()``): when the caller accepted it; now by default."""
        self.raise_if_dead()
        params = request.sampling_params
        if params is None or params.n == 1:
            self._add_one(request, prompt, arrival_time)
            return
        rid = request.request_id
        if rid in self.outputs.parents or rid in self.scheduler.requests:
            raise ValueError(f"duplicate request_id {rid!r}: a request with this id is still running")
        parent = ParentRequest(request)
        added: list[str] = []
        try:
            for index, child in enumerate(parent.make_children(request)):
                self._add_one(child, prompt, arrival_time, parent, index)
                added.append(child.request_id)
        except BaseException:
            for child_id in added:
                self._release(self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED))
            self.outputs.drop_parent(rid)
            raise

    def _add_one(self, request: Request, prompt: str | None, arrival_time: float | None = None,
                 parent: ParentRequest | None = None, index: int = 0) -> None:
        matcher = self.structured.take(request, copy=index > 0)
        self.scheduler.add_request(request)
        try:
            self.outputs.add_request(request, prompt, arrival_time, parent, index)
        except BaseException:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
            raise
        self.num_prompt_tokens += request.num_prompt_tokens
        self.structured.add(request.request_id, matcher)
        request.grammar = None  # the structured manager holds it now

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a running or waiting request (a parent: all its children in flight); its final
        output (``finish_reason="abort"``), or None for an id that is not in flight."""
        finals = []
        for rid in self.outputs.child_ids(request_id) or [request_id]:
            request = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if request is not None:
                finals.append(self._final_output(request))
        outputs = self.outputs.gather([o for o in finals if o is not None])
        return outputs[-1] if outputs else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def is_healthy(self) -> bool:
        return self.dead is None

    def get_stats(self) -> EngineStats:
        """Engine-wide figures (``engine.core.stats``); call between steps."""
        return collect_stats(self)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs it produced (errored requests' final outputs included)."""
        self.raise_if_dead()
        if not self.scheduler.has_unfinished_requests():
            return []
        self._progress = False
        self._fault_outputs = []
        self._skip = self.structured.plan_step(len(self.scheduler.requests))
        try:
            outputs = self._try(None)
        except EngineDeadError:
            raise
        except Exception:
            outputs = self._recover()
        else:
            self.failed_steps_in_a_row = 0
        faulted, self._fault_outputs = self._fault_outputs, []
        return faulted + outputs if faulted else outputs

    def _attempt(self, only: Collection[str] | None) -> list[RequestOutput]:
        scheduler, speculator, outputs, structured = self.scheduler, self.speculator, self.outputs, self.structured
        participants = self._participants = set()
        if speculator.enabled:
            participants.update(r.request_id for r in scheduler.decoding_requests(only))
        dirty = False
        scheduler.begin_step()
        step_start = time.monotonic()
        self._step_clock = time.perf_counter()
        try:
            drafts = speculator.propose(scheduler, only)
            with deferred_sigint():
                if drafts is not None:
                    scheduler.add_drafts(structured.trim_drafts(drafts))
                sched = scheduler.schedule(only, self._skip)
            participants.update(sr.request_id for sr in sched.scheduled)
            sched.grammar_bitmask = structured.grammar_bitmask(sched)
            dirty = True
            result = self.runner.execute(sched)
            plan = scheduler.plan_update(sched, result)
            structured.prepare(plan)
            step_outputs = outputs.prepare(plan, step_start)
        except BaseException:
            with deferred_sigint():
                outputs.rollback()
                structured.rollback()
                speculator.rollback()
                scheduler.rollback_step(dirty)
            raise
        with deferred_sigint():
            return self._commit(sched, plan, step_outputs, result.aux_hidden_states)

    def _commit(self, sched: SchedulerOutput, plan: list[EngineCoreOutput],
                step_outputs: list[RequestOutput], aux_hidden_states=None) -> list[RequestOutput]:
        """Commit the step; its outputs with children's gathered into their parents'.
        ``aux_hidden_states``: the target's tap states of the step's rows (EAGLE-3), or None."""
        try:
            finished = self.scheduler.apply_update(sched, plan)
            self.outputs.commit()
            generated = sum(len(entry.new_token_ids) for entry in plan)
            self.num_generated_tokens += generated
            self.throughput.add(generated)
            self.structured.commit(plan)
            self.speculator.commit(plan, sched, self._step_seconds(), aux_hidden_states)
            for request in finished:
                self._release(request)
            return self.outputs.gather(step_outputs)
        except BaseException as exc:  # a bug: the state may be half committed
            self._die(exc)

    def _step_seconds(self) -> float:
        """Wall seconds of this attempt so far (drafting, scheduling, the runner, outputs): the
        time the draft-length controller's cost model learns from. The whole step, not the
        runner's forward alone: drafting, verification bookkeeping and output processing are
        what a user waits for too, and they grow with the drafts."""
        return time.perf_counter() - self._step_clock

    # ------------------------------------------------------------------ faults
    def _try(self, only: Collection[str] | None) -> list[RequestOutput]:
        """One attempt (again without the requests a ``RequestFault`` ended or a ``MaskDeferral``
        left out, which count as no failure); counts engine faults and notes progress (an attempt
        that ran something)."""
        while True:
            try:
                outputs = self._attempt(only)
                break
            except RequestFault as fault:
                self._end_faulted(fault)
            except MaskDeferral as deferral:
                self._skip = self._skip | deferral.request_ids
            except EngineDeadError:
                raise
            except Exception as fault:
                self.num_failed_attempts += 1
                logger.warning("tokenbudget: step failed (%s: %s)", type(fault).__name__, short(fault))
                raise
        if self._participants:
            self._progress = True
        return outputs

    def _try_twice(self, only: Collection[str]) -> list[RequestOutput]:
        try:
            return self._try(only)
        except EngineDeadError:
            raise
        except Exception:
            return self._try(only)

    def _recover(self) -> list[RequestOutput]:
        """The step failed once: retry it, then isolate the requests that make it fail; decide
        whether the fault is the engine's (see the module docstring)."""
        first_participants = self._participants
        try:
            outputs = self._try(None)  # transient faults pass here
        except EngineDeadError:
            raise
        except Exception as fault:
            last_fault = fault
        else:
            self.failed_steps_in_a_row = 0
            return outputs
        # Both attempts' participants: the two may fail at different points (a proposer fault
        # sees only decoding requests), and a request blamed must have been in the failure.
        suspects = sorted(first_participants | self._participants) or sorted(self.scheduler.requests)
        outputs = []
        failed_alone: list[tuple[str, Exception]] = []
        self._isolate(suspects, last_fault, outputs, failed_alone)
        # Every request of the step failing alone is an engine fault, unless they are the children
        # of one request (its n samples): that is one request failing, however many children.
        owners = {self.outputs.parent_id(rid) for rid, _ in failed_alone}
        if len(failed_alone) >= 2 and len(failed_alone) == len(suspects) and len(owners) >= 2:
            self._die(failed_alone[-1][1], [rid for rid, _ in failed_alone])
        self.failed_steps_in_a_row = 0 if self._progress else self.failed_steps_in_a_row + 1
        if self.failed_steps_in_a_row >= self.max_failed_steps:
            self._die(last_fault if not failed_alone else failed_alone[-1][1])
        finals = [self._fail_request(request_id, fault) for request_id, fault in failed_alone]
        outputs.extend(self.outputs.gather([out for out in finals if out is not None]))
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

    def _end_faulted(self, fault: RequestFault) -> None:
        """End the requests a ``RequestFault`` names (the step was rolled back); their final
        outputs go out with this step's."""
        ended = []
        for request_id, reason in fault.reasons.items():
            request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            if request is None:
                continue
            self.num_errored_requests += 1
            logger.warning("tokenbudget: request %r ended by its own fault: %s", request_id, reason)
            ended.append(self._final_output(request, reason))
        if not ended:  # names no request in flight: a bug, so an engine fault
            raise RuntimeError(f"a RequestFault named no request in flight: {fault}") from fault
        self._fault_outputs.extend(self.outputs.gather([out for out in ended if out is not None]))

    def _fail_request(self, request_id: str, fault: Exception) -> RequestOutput | None:
        """End a request that fails alone; its final output (a child's, not yet gathered)."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        if request is None:
            return None
        self.num_errored_requests += 1
        logger.warning("tokenbudget: request %r failed alone and was ended: %s: %s", request_id,
                       type(fault).__name__, short(fault))
        return self._final_output(request, short(f"{type(fault).__name__}: {fault}"))

    def _die(self, fault: BaseException, failed_alone: list[str] | None = None) -> None:
        dead = EngineDeadError(f"the engine stopped serving after {type(fault).__name__}: {short(fault)}",
                               failed_alone or [])
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
            raise EngineDeadError(str(self.dead), self.dead.failed_alone) from self.dead.__cause__

    # ------------------------------------------------------------------ the one fan-out
    def _final_output(self, request: Request, error: str | None = None) -> RequestOutput | None:
        """Final output of a request ended between steps (not yet gathered), then release it."""
        out = self.outputs.final_output(request, error)
        self._release(request)
        return out

    def _release(self, request: Request) -> None:
        self.speculator.on_finished(request)
        self.outputs.on_finished(request)
        self.structured.on_finished(request)
