"""The token-budget scheduler.

There is no prefill phase and no decode phase. Each step gives every request
``n = min(num_tokens_with_spec - num_computed_tokens, budget left, max_model_len limit)``
tokens, running requests first (in policy order), then waiting ones, until the token budget or
``max_num_seqs`` is spent. ``num_computed_tokens`` advances optimistically when a request is
scheduled (drafts included) and rolls back by the number of rejected drafts when the step is
committed, whose KV blocks are then returned to the pool.

A step is a transaction (``engine.core.engine_core`` drives it):

    begin_step()  ->  add_drafts(batch)  ->  schedule()  ->  plan_update(sched, out)  ->  apply_update(plan)
                      \\______________ journaled; rollback_step(dirty) undoes _______/     commit: cannot fail

``requests`` (the live ``Request`` objects) and the KV manager's block tables are
``RequestTable``s whose records, unlike those above the scheduler, change in place (a new record
per change in this hot loop cost too much: benches/RESULTS.md, "Figures behind decisions in the
source"); every change to them, the queues and the pool records its inverse in the step's
``UndoLog`` (``kv_cache.journal``). ``plan_update`` changes nothing (``scheduler.plan``);
``apply_update`` commits. Between steps, ``add_request`` and ``finish_request`` change the queues.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Collection
from operator import attrgetter

from tokenbudget.kv_cache.journal import UndoLog
from tokenbudget.kv_cache.manager import KVCacheManager
from tokenbudget.request_table import RequestTable
from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.drafts import DraftBatch, set_drafts
from tokenbudget.scheduler.integrity import check_scheduler_integrity
from tokenbudget.scheduler.output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    scheduled_chunk,
)
from tokenbudget.scheduler.plan import plan_update
from tokenbudget.scheduler.queues import heads, make_queue, pop_head
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.validation import validate_new_request

RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager | None = None) -> None:
        self.config = config
        self.kv = kv_manager or KVCacheManager(config.num_blocks, config.block_size,
                                               config.max_model_len, config.enable_prefix_caching)
        self.requests: RequestTable[Request] = RequestTable("scheduler requests")
        self.waiting = make_queue(config.policy)
        # Kept sorted by policy key: the last running request is the preemption victim.
        self.running: list[Request] = []
        self._key = (attrgetter("priority", "arrival_index") if config.policy == "priority"
                     else attrgetter("arrival_index"))
        self._next_arrival = 0
        self._journal: UndoLog | None = None  # set while a step is open
        self._events_mark = 0  # staged KV events before the open step (kv_cache.events)
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError (changing nothing) on a bad one."""
        assert self._journal is None, "add_request inside a step"
        validate_new_request(request, self.config, self.requests, self.kv)
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.requests.set(request.request_id, request)
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> Request | None:
        """End a request between steps (abort, error): its blocks return to the pool at once.
        Returns the request, or None for an unknown id."""
        assert self._journal is None, "finish_request inside a step"
        assert status.is_finished
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status, request.stop_reason = status, stop_reason
        self._release(request)
        return request

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids, request.spec_probs = [], None
        self.requests.drop(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return len(self.requests) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def decoding_requests(self, only: Collection[str] | None = None) -> list[Request]:
        """Running requests whose next step samples, that may speculate (``only``: among these ids)."""
        return [r for r in self.running
                if r.num_computed_tokens == len(r.all_token_ids) - 1 and r.max_spec_tokens != 0
                and (only is None or r.request_id in only)]

    # ------------------------------------------------------------------ one step: journaled part
    def begin_step(self) -> None:
        assert self._journal is None, "a step is already open"
        self._journal = UndoLog()
        self.kv.set_journal(self._journal)
        events = self.kv.pool.events
        self._events_mark = events.mark() if events is not None else 0

    def add_drafts(self, batch: DraftBatch) -> None:
        """Set next step's drafts (and their probabilities), each cut to ``draft_limit`` (journaled)."""
        set_drafts(self.requests.get, batch, self.config.max_model_len, self._journal)

    def schedule(self, only: Collection[str] | None = None, skip: Collection[str] = ()) -> SchedulerOutput:
        """This step's batch. ``only``: schedule just these request ids (fault isolation);
        ``skip``: leave these out of this step (structured requests waiting for their share of
        the grammar-mask budget), running or waiting."""
        journal = self._journal
        assert journal is not None, "schedule() outside begin_step()"
        cfg = self.config
        lookahead = cfg.num_lookahead_tokens
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput(num_lookahead_tokens=lookahead)
        scheduled = out.scheduled
        journal.record(self._undo_advances, scheduled)  # filled below; one record for them all
        running = self.running
        # a seat freed for a waiting request that outranks a running one; like a preemption for
        # KV, nothing is admitted in the step that preempted: the newcomer takes the seat next step
        preempted = cfg.policy == "priority" and only is None and not skip and self._make_room_for_priority(out)
        # Hot loop (once per running request): n = min(tokens with drafts - computed, budget,
        # max_model_len room, threshold), then the chunk, the counter advanced optimistically.
        max_model_len = cfg.max_model_len
        threshold = cfg.long_prefill_token_threshold
        allocate_slots = self.kv.allocate_slots
        append = scheduled.append
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if (only is not None and request.request_id not in only) or request.request_id in skip:
                i += 1
                continue
            computed = request.num_computed_tokens
            all_ids = request.all_token_ids
            num_committed = len(all_ids)
            spec_ids = request.spec_token_ids
            n = num_committed + len(spec_ids) - computed
            if n > budget:
                n = budget
            if n > max_model_len - computed:
                n = max_model_len - computed
            if threshold and n > threshold:
                n = threshold
            assert n >= 1, f"{request.request_id}: running with nothing to compute"
            block_ids = allocate_slots(request, n, lookahead)
            while block_ids is None:
                victim = running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
                block_ids = allocate_slots(request, n, lookahead)
            if block_ids is None:
                break
            end = computed + n
            append(scheduled_chunk(request, computed, end, block_ids, is_new=False))
            request.num_computed_tokens = end
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, only, skip)
        out.total_num_scheduled_tokens = cfg.max_num_batched_tokens - budget
        return out

    def _make_room_for_priority(self, out: SchedulerOutput) -> bool:
        """Priority policy, ``max_num_seqs`` full: a waiting request that outranks the lowest
        running one (smaller ``(priority, arrival)``) takes its seat; the victim is preempted
        (``_preempt``: lowest priority, latest arrival first). Else a long run of low-priority
        requests would hold every seat while a high-priority one waits (the inversion of vLLM's
        #40004). The victim ranks below every request still running, so it cannot take a seat
        back before the newcomer is admitted (next step: it is then the waiting queue's head). Returns
        whether it preempted."""
        waiting, running, key = self.waiting, self.running, self._key
        if (len(running) >= self.config.max_num_seqs and len(waiting)
                and key(waiting.peek()) < key(running[-1]) and not self._waits_for_prefix(waiting.peek())):
            self._preempt(running[-1], out)
            return True
        return False

    def _waits_for_prefix(self, request: Request) -> bool:
        return (request.shares_prefix_with is not None and self.config.enable_prefix_caching
                and request.waits_for_prefix)

    def _undo_advances(self, dirty: bool, scheduled: list[ScheduledRequest]) -> None:
        """Running requests scheduled this step back to their counts (admitted ones: ``_undo_admit``)."""
        requests = self.requests
        for sr in scheduled:
            if not sr.is_new:
                requests[sr.request_id].num_computed_tokens = sr.num_computed_tokens

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest],
                       only: Collection[str] | None, skip: Collection[str]) -> int:
        cfg, kv, waiting, running = self.config, self.kv, self.waiting, self.running
        in_order = only is None and not skip  # else some are passed over: taken out of the queue by id
        candidates = heads(waiting) if in_order else [
            r for r in waiting if (only is None or r.request_id in only) and r.request_id not in skip]
        for request in candidates:
            if budget <= 0 or len(running) >= cfg.max_num_seqs:
                break
            if self._waits_for_prefix(request):
                if only is None:
                    break  # the head waits one step or so for its sibling's prompt, then hits the cache
                continue
            hits, num_hit = kv.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            if n > budget:
                n = budget
            if cfg.long_prefill_token_threshold and n > cfg.long_prefill_token_threshold:
                n = cfg.long_prefill_token_threshold
            block_ids = kv.allocate_slots(request, n, cfg.num_lookahead_tokens, hits, num_hit)
            if block_ids is None:
                break
            if kv.looks_up(request):
                kv.record_prefix_lookup(request.num_tokens, num_hit)
            position = pop_head(waiting) if in_order else waiting.remove(request)
            self._journal.record(self._undo_admit, request, position, request.status, request.num_cached_tokens)
            request.status = RUNNING
            request.num_cached_tokens = num_hit
            insort(running, request, key=self._key)
            request.num_computed_tokens = num_hit + n  # advanced optimistically, as in schedule()
            scheduled.append(scheduled_chunk(request, num_hit, num_hit + n, block_ids, is_new=True))
            budget -= n
        return budget

    def _undo_admit(self, dirty: bool, request: Request, position, status: RequestStatus, num_cached: int) -> None:
        self.running.remove(request)
        request.status, request.num_computed_tokens, request.num_cached_tokens = status, 0, num_cached
        self.waiting.prepend(request, position)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute later: free every block, forget computed KV and drafts, back to the queue head.
        Journaled as one group: a rollback after a forward pass keeps the preemption (the freed
        blocks may hold that pass's KV now), any other rollback undoes it whole."""
        group = UndoLog()
        self._journal.record(self._undo_preempt, request, group, request.status, request.num_computed_tokens,
                             request.spec_token_ids, request.spec_probs)
        self.kv.set_journal(group)
        self.running.remove(request)
        self.kv.free(request)
        self.kv.set_journal(self._journal)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_probs = [], None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        out.preempted_request_ids.append(request.request_id)

    def _undo_preempt(self, dirty: bool, request: Request, group: UndoLog, status, computed, spec, probs) -> None:
        if dirty:
            return
        self.waiting.remove(request)
        group.rollback(dirty)
        request.status, request.num_computed_tokens = status, computed
        request.spec_token_ids, request.spec_probs = spec, probs
        request.num_preemptions -= 1
        self.num_preemptions -= 1
        insort(self.running, request, key=self._key)

    def rollback_step(self, dirty: bool) -> None:
        """Undo everything since ``begin_step`` (see ``kv_cache.journal`` for ``dirty``)."""
        journal = self._journal
        assert journal is not None, "no step to roll back"
        self.kv.set_journal(None)
        self._journal = None
        events = self.kv.pool.events
        if events is not None:
            events.discard_from(self._events_mark)  # the step's evictions: undone, or staged again below
        journal.rollback(dirty)
        if events is not None:
            events.publish()  # the hashes a dirty rollback could not give back

    # ------------------------------------------------------------------ one step: plan and commit
    def plan_update(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """What committing the runner's output would do (``scheduler.plan``); changes nothing."""
        return plan_update(self.requests.get, self.config.max_model_len, sched, output)

    def apply_update(self, sched: SchedulerOutput, plan: list[EngineCoreOutput]) -> list[Request]:
        """Commit the step: append tokens, roll back rejected drafts and rewind their blocks, cache
        full blocks, finish requests. Returns the requests that finished (already released)."""
        self.kv.set_journal(None)
        self._journal = None
        kv = self.kv
        lookahead = self.config.num_lookahead_tokens
        request_of = self.requests.get
        finished: list[Request] = []
        for sr, entry in zip(sched.scheduled, plan):
            request = request_of(sr.request_id)
            if not sr.needs_sample:  # a partial prefill chunk
                kv.cache_blocks(request)
                continue
            num_drafts, num_accepted = entry.num_draft_tokens, entry.num_accepted_tokens
            if num_drafts != num_accepted:
                request.num_computed_tokens -= num_drafts - num_accepted
            request.spec_token_ids, request.spec_probs = [], None
            request.all_token_ids.extend(entry.new_token_ids)
            if entry.finish_status is not None:
                request.status, request.stop_reason = entry.finish_status, entry.stop_reason
                finished.append(request)
                self._release(request)
            else:
                if num_drafts != num_accepted:
                    kv.rewind(request, lookahead)
                kv.cache_blocks(request)
        if finished:
            self.running = [r for r in self.running if r.status == RUNNING]
        if kv.pool.events is not None:
            kv.pool.events.publish()  # the step's KV events (kv_cache.events), in order, at its commit
        return finished

    @property
    def in_step(self) -> bool:
        return self._journal is not None

    def check_integrity(self) -> None:
        """Assert the design's invariants 3, 4, 5, 6 on the current state (tests call it every step)."""
        check_scheduler_integrity(self)

