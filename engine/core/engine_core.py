"""EngineCore: the only step loop, and each step a transaction.

``LLMEngine``, ``AsyncLLM``, ``LLM``, the benches' synthetic engine and the scheduler fuzzer all
drive this one object; what differs between them (a real or a fake runner, a tokenizer or none)
is what they pass in. One step:

    skip   = structured.plan_step(n)                  # (once a step) grammar requests past their mask share
    drafts = speculator.propose(scheduler)            # drafts (+ probabilities) for decoding requests
    drafts = structured.trim_drafts(drafts)           #   cut at the first token a grammar forbids
    scheduler.add_drafts(drafts)                      #   cut to draft_limit
    sched  = scheduler.schedule(skip=skip)            # token budget; counters advance optimistically
    masks.start(sched)                                # masks of the sampling rows, often beside the forward
    result = runner.execute(sched)                    # one forward + masks applied + sampling/verification
    sched.grammar_masks()                             #   a mask fault fails the attempt even if unapplied
    plan   = scheduler.plan_update(sched, result)     # what the step commits; changes nothing
    structured.prepare(plan)                          # grammars consume the tokens (may end requests)
    outs   = outputs.prepare(plan)                    # text, stop strings (may end requests)
    --- commit: the tables' step closed, scheduler.apply_update, structured.commit,
        speculator.commit, the release of finished requests

**The grammar-mask budget** (``engine.structured.mask_budget``): the structured requests whose
share of the step's mask CPU is used up sit the step out (``skip``); a ``MaskDeferral`` (the
budget ran out while masks were made) rolls the attempt back like a request fault and runs it
again with those requests left out too. Neither ends nor blames anyone.

Everything before the commit either changes nothing or journals its changes, so when anything
there raises (model, sampler, proposer, a kernel, the detokenizer) the step is rolled back:
counters, blocks, prefix-cache entries, drafts, proposer/controller, grammar and output state are
as they were (``kv_cache.journal`` says what a rollback after a forward pass keeps for safety).
Per-request state lives in ``RequestTable``s (``tokenbudget.request_table``): every component above
the scheduler lists its tables (``tables``), and each attempt begins all of them, rolls them all
back on a fault and commits them all before the commit. What cannot be a replaced record has its
own undo: the scheduler's ``UndoLog`` for the live requests and their block tables (changed in
place in the hot loop), the queues and the block pool; the grammar matchers' consumed tokens.
What follows a failed attempt (a request's own fault, a retry, isolating the requests that
make steps fail, the engine's death) is ``engine.core.recovery``, a base class of ``EngineCore``.

The commit cannot fail by design (no I/O, no model code); if it does anyway, the state may be
half committed and the engine declares itself dead rather than serve from it. ``KeyboardInterrupt``
and ``CancelledError`` roll the step back and propagate; SIGINT is held during the sections that
change state (``interrupts.deferred_sigint``).

One release path, ``_release(request)``, drops a finished or aborted request's records from every
table (proposer state, acceptance evidence, grammar matcher, output state) and lets the proposer
keep what it learnt (suffix decoding's global cache); the scheduler frees its KV blocks when it
finishes the request.

A request with ``n > 1`` enters as n child requests (``engine.core.parallel_sampling``); each is
scheduled, isolated on a fault and finished on its own, and their outputs are gathered into the
parent's after the commit. Aborting the parent's id aborts every child still in flight.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from tokenbudget.api.errors import EngineDeadError
from tokenbudget.api.outputs import RequestOutput
from tokenbudget.engine.core.interrupts import deferred_sigint
from tokenbudget.engine.core.output_processor import OutputProcessor
from tokenbudget.engine.core.parallel_sampling import ParentRequest
from tokenbudget.engine.core.recovery import StepRecovery
from tokenbudget.engine.core.stats import EngineStats, ThroughputMeter, collect_stats
from tokenbudget.engine.structured.manager import StructuredOutputs
from tokenbudget.engine.structured.mask_overlap import MaskOverlap
from tokenbudget.request_table import RequestTable
from tokenbudget.scheduler.output import EngineCoreOutput, SchedulerOutput
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.scheduler import Scheduler
from tokenbudget.spec.speculator import Speculator


class EngineCore(StepRecovery):
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
        self.masks = MaskOverlap(self.structured)
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

    @property
    def tables(self) -> tuple[RequestTable, ...]:
        """The records of every component above the scheduler: journaled together in each step
        attempt, released together (the scheduler's own are journaled in its ``UndoLog``)."""
        return (*self.outputs.tables, *self.structured.tables, *self.speculator.tables)

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
        dirty, sched = False, None
        tables = self.tables
        scheduler.begin_step()
        for table in tables:
            table.begin()
        step_start = time.monotonic()
        self._step_clock = time.perf_counter()
        try:
            drafts = speculator.propose(scheduler, only)
            with deferred_sigint():
                if drafts is not None:
                    scheduler.add_drafts(structured.trim_drafts(drafts))
                sched = scheduler.schedule(only, self._skip)
            participants.update(sr.request_id for sr in sched.scheduled)
            self.masks.start(sched)
            dirty = True
            result = self.runner.execute(sched)
            sched.grammar_masks()
            plan = scheduler.plan_update(sched, result)
            structured.prepare(plan)
            step_outputs = outputs.prepare(plan, step_start)
        except BaseException:
            self.masks.wait(sched)  # the mask thread is off the matchers before they roll back
            with deferred_sigint():
                for table in tables:
                    table.rollback()
                structured.rollback()
                scheduler.rollback_step(dirty)
            raise
        with deferred_sigint():
            for table in tables:
                table.commit()
            return self._commit(sched, plan, step_outputs, result.aux_hidden_states)

    def _commit(self, sched: SchedulerOutput, plan: list[EngineCoreOutput],
                step_outputs: list[RequestOutput], aux_hidden_states=None) -> list[RequestOutput]:
        """Commit the step; its outputs with children's gathered into their parents'.
        ``aux_hidden_states``: the target's tap states of the step's rows (EAGLE-3), or None."""
        try:
            finished = self.scheduler.apply_update(sched, plan)
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

    # ------------------------------------------------------------------ the one fan-out
    def _final_output(self, request: Request, error: str | None = None) -> RequestOutput | None:
        """Final output of a request ended between steps (not yet gathered), then release it."""
        out = self.outputs.final_output(request, error)
        self._release(request)
        return out

    def _release(self, request: Request) -> None:
        for table in self.tables:
            table.drop(request.request_id)
        self.structured.forget(request.request_id)
        self.speculator.on_finished(request)
