"""The token-budget scheduler.

There is no prefill phase and no decode phase. Each step gives every request
``n = min(num_tokens_with_spec - num_computed_tokens, budget left, max_model_len limit)``
tokens, running requests first (in policy order), then waiting ones, until the token budget or
``max_num_seqs`` is spent. ``num_computed_tokens`` advances optimistically when a request is
scheduled (drafts included) and rolls back by the number of rejected drafts in
``update_from_output``, whose KV blocks are then returned to the pool.
"""

from __future__ import annotations

from bisect import insort
from operator import attrgetter
from typing import Iterable, Mapping

from tokenbudget.kv_cache.manager import KVCacheManager
from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.integrity import check_scheduler_integrity
from tokenbudget.scheduler.output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenbudget.scheduler.queues import make_queue
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.stop import append_and_check_stop
from tokenbudget.scheduler.validation import validate_new_request

RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager | None = None) -> None:
        self.config = config
        self.kv = kv_manager or KVCacheManager(config.num_blocks, config.block_size,
                                               config.max_model_len, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        # Kept sorted by policy key: the last running request is the preemption victim.
        self.running: list[Request] = []
        self._key = (attrgetter("priority", "arrival_index") if config.policy == "priority"
                     else attrgetter("arrival_index"))
        self._next_arrival = 0
        self._finished_pending: list[str] = []
        # Requests that finished or were aborted, for components that keep per-request state
        # (drafters, output processors); drained with ``pop_finished_requests``.
        self._finished_requests: list[Request] = []
        self._preempted_pending: list[str] = []
        self._in_step = False
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError (changing nothing) on a bad one."""
        validate_new_request(request, self.config, self.requests, self.kv)
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests by id; unknown or already finished ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._finish(request)

    def _finish(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        del self.requests[request.request_id]
        self._finished_pending.append(request.request_id)
        self._finished_requests.append(request)

    def pop_finished_requests(self) -> list[Request]:
        done, self._finished_requests = self._finished_requests, []
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv
        lookahead = cfg.num_lookahead_tokens
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput(finished_request_ids=self._finished_pending, num_lookahead_tokens=lookahead)
        self._finished_pending = []
        scheduled = out.scheduled
        running = self.running
        preempted = False
        # Hot loop: n = min(tokens with drafts - computed, budget, max_model_len room, threshold),
        # then the body of _advance, inlined for speed (this loop runs once per running request).
        max_model_len = cfg.max_model_len
        threshold = cfg.long_prefill_token_threshold
        allocate_slots = kv.allocate_slots
        append = scheduled.append
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            all_ids = request.all_token_ids
            num_committed = len(all_ids)
            n = num_committed + len(request.spec_token_ids) - computed
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
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                block_ids = allocate_slots(request, n, lookahead)
            if block_ids is None:
                break
            end = computed + n
            if end <= num_committed:
                spec: list[int] = []
                token_ids = all_ids[computed:end]
            else:
                spec = request.spec_token_ids[:end - num_committed]
                token_ids = all_ids[computed:] + spec
            request.num_computed_tokens = end
            append(ScheduledRequest(request, computed, n, token_ids, spec, block_ids, False, end >= num_committed))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        out.total_num_scheduled_tokens = cfg.max_num_batched_tokens - budget
        out.preempted_request_ids = self._preempted_pending
        self._preempted_pending = []
        self._in_step = True
        return out

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        cfg, kv, waiting, running = self.config, self.kv, self.waiting, self.running
        while len(waiting) and budget > 0 and len(running) < cfg.max_num_seqs:
            request = waiting.peek()
            hits, num_hit = kv.get_computed_blocks(request)
            request.num_computed_tokens = 0
            n = min(request.num_tokens - num_hit, budget)
            if cfg.long_prefill_token_threshold:
                n = min(n, cfg.long_prefill_token_threshold)
            block_ids = kv.allocate_slots(request, n, cfg.num_lookahead_tokens, hits, num_hit)
            if block_ids is None:
                break
            waiting.pop()
            request.status = RUNNING
            request.num_computed_tokens = num_hit
            request.num_cached_tokens = num_hit
            insort(running, request, key=self._key)
            scheduled.append(self._advance(request, n, block_ids, True))
            budget -= n
        return budget

    @staticmethod
    def _advance(request: Request, n: int, block_ids: list[int], is_new: bool) -> ScheduledRequest:
        """Record the scheduled chunk and advance ``num_computed_tokens`` optimistically."""
        start = request.num_computed_tokens
        end = start + n
        all_ids = request.all_token_ids
        num_committed = len(all_ids)
        if end <= num_committed:
            spec: list[int] = []
            token_ids = all_ids[start:end]
        else:
            spec = request.spec_token_ids[:end - num_committed]
            token_ids = all_ids[start:] + spec
        request.num_computed_tokens = end
        return ScheduledRequest(request, start, n, token_ids, spec, block_ids, is_new, end >= num_committed)

    def _preempt(self, request: Request) -> None:
        """Recompute later: free every block, forget computed KV and drafts, back to the queue head."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        self._preempted_pending.append(request.request_id)

    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Commit sampled tokens, roll back rejected drafts, rewind their blocks, apply stops."""
        self._in_step = False
        kv = self.kv
        lookahead = self.config.num_lookahead_tokens
        max_model_len = self.config.max_model_len
        logprobs = output.logprobs
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        cache_blocks = kv.cache_blocks
        append = outputs.append
        for idx, (sr, tokens) in enumerate(zip(sched.scheduled, output.sampled_token_ids)):
            request = sr.request
            if request.status != RUNNING:
                continue  # aborted while the step ran
            if not tokens:
                assert not sr.needs_sample, f"{request.request_id}: no token sampled at the end of its chunk"
                cache_blocks(request)
                continue
            num_drafts = len(sr.spec_token_ids)
            num_tokens = len(tokens)
            num_accepted = num_tokens - 1
            assert 0 <= num_accepted <= num_drafts, f"{request.request_id}: {num_tokens} tokens for {num_drafts} drafts"
            if num_drafts:
                request.num_computed_tokens -= num_drafts - num_accepted
                # per-request acceptance counters (inlined: hot path)
                request.num_draft_steps += 1
                request.num_draft_tokens += num_drafts
                request.num_accepted_tokens += num_accepted
                per_pos = request.accepted_per_pos
                if len(per_pos) < num_drafts:
                    per_pos.extend([0] * (num_drafts - len(per_pos)))
                for j in range(num_accepted):
                    per_pos[j] += 1
            request.spec_token_ids = []
            n = append_and_check_stop(request, tokens, max_model_len)
            new_tokens = tokens if n == num_tokens else tokens[:n]
            out = EngineCoreOutput(request.request_id, new_tokens, None, None, num_drafts, num_accepted,
                                   logprobs[idx][:n] if logprobs is not None and logprobs[idx] is not None else None)
            if request.status != RUNNING:
                out.finish_reason = request.finish_reason
                out.stop_reason = request.stop_reason
                self._finish(request)
                any_finished = True
            else:
                if num_drafts != num_accepted:
                    kv.rewind(request, lookahead)
                cache_blocks(request)
            append(out)
        if any_finished:
            self.running = [r for r in self.running if r.status == RUNNING]
        return outputs

    def update_draft_token_ids(self, drafts: Mapping[str, list[int]]) -> None:
        """Set next step's drafts, clipped so a verify never runs past ``max_model_len`` nor
        proposes more tokens than ``max_tokens`` leaves room for (the verify adds one more)."""
        max_model_len = self.config.max_model_len
        requests = self.requests
        for rid, tokens in drafts.items():
            request = requests.get(rid)
            if request is None or request.status != RUNNING:
                continue
            num_tokens = len(request.all_token_ids)
            room = min(max_model_len - num_tokens,
                       request.max_tokens - (num_tokens - len(request.prompt_token_ids)) - 1)
            if request.max_spec_tokens is not None:
                room = min(room, request.max_spec_tokens)
            request.spec_token_ids = list(tokens[:max(room, 0)])

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert DESIGN.md invariants 3, 4, 5, 6 on the current state (tests call it every step)."""
        check_scheduler_integrity(self)
