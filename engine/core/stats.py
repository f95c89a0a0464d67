"""Engine-wide figures (``get_stats()``) and admission control.

``EngineStats`` is one snapshot, taken between steps by the thread that steps the engine (so the
figures agree with each other: no step is half counted). ``AsyncLLM`` takes one after every
step and answers ``get_stats()`` from it, so a server reads it without touching the engine.

Admission control bounds what waits: requests queued but not yet running (the scheduler's
waiting queue, preempted ones included, plus what ``AsyncLLM`` has accepted but not yet handed
to the engine). Past ``max_queued_requests`` / ``max_queued_tokens`` (prompt tokens), a new
request is refused with ``EngineOverloadedError`` instead of letting the queue grow without
bound. A request that would wait alone is always admitted, so no prompt is refused forever.
Structured requests are bounded by the CPU their grammar masks need: past
``max_grammar_mask_ms_in_flight`` (the estimates of every structured request in flight, all
running or waiting), a new one is refused; the step shares its own mask budget between those in
flight (``engine.structured.mask_budget``), so this bounds how long each waits for its turns.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec

from tokenbudget.api.errors import EngineOverloadedError
from tokenbudget.scheduler.request import RequestStatus

_WINDOW_S = 10.0  # tokens/s is measured over the last few seconds of steps


class EngineStats(msgspec.Struct, kw_only=True):
    healthy: bool = True
    num_running: int = 0
    num_waiting: int = 0  # in the waiting queue, preempted ones included
    num_preempted: int = 0  # of the waiting, those preempted (waiting to be recomputed)
    num_waiting_tokens: int = 0  # prompt tokens of the waiting requests
    num_preemptions_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_usage: float = 0.0  # kv_blocks_used / kv_blocks_total
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of those, served from the prefix cache
    num_prompt_tokens_total: int = 0  # prompt tokens of the requests accepted
    num_generation_tokens_total: int = 0  # output tokens committed
    num_errored_requests_total: int = 0
    spec_num_drafts: int = 0  # verify steps that had drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_drafted_per_pos: list[int] = []
    spec_accepted_per_pos: list[int] = []
    generation_tokens_per_s: float = 0.0  # over the last ~10 s
    grammar_mask_ms: float = 0.0  # estimated CPU ms of one step's masks of the structured requests in flight

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_acceptance_by_position(self) -> list[float]:
        """P(draft i accepted | draft i proposed), per position i."""
        return [a / d if d else 0.0 for a, d in zip(self.spec_accepted_per_pos, self.spec_drafted_per_pos)]


class ThroughputMeter:
    """Committed output tokens over a sliding window of recent steps."""

    def __init__(self, window_s: float = _WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def add(self, num_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, num_tokens))
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        events = [(t, n) for t, n in self._events if t >= now - self.window_s]
        if not events:
            return 0.0
        span = max(now - events[0][0], 1e-3)
        return sum(n for _, n in events) / span


def collect_stats(core) -> EngineStats:
    """A snapshot of ``core`` (an ``EngineCore``); call it between steps, from the stepping thread."""
    scheduler = core.scheduler
    waiting = list(scheduler.waiting)
    usage = scheduler.kv.usage()
    spec = core.speculator.stats if core.speculator.enabled else None
    return EngineStats(
        healthy=core.is_healthy(), num_running=len(scheduler.running), num_waiting=len(waiting),
        num_preempted=sum(r.status == RequestStatus.PREEMPTED for r in waiting),
        num_waiting_tokens=sum(r.num_prompt_tokens for r in waiting),
        num_preemptions_total=scheduler.num_preemptions,
        kv_blocks_used=usage.num_blocks - usage.num_free_blocks, kv_blocks_total=usage.num_blocks,
        kv_usage=usage.usage, prefix_cache_queries=usage.prefix_cache_queries,
        prefix_cache_hits=usage.prefix_cache_hits, num_prompt_tokens_total=core.num_prompt_tokens,
        num_generation_tokens_total=core.num_generated_tokens,
        num_errored_requests_total=core.num_errored_requests,
        spec_num_drafts=spec.num_drafts if spec else 0, spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
        spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        spec_drafted_per_pos=list(spec.drafted_per_pos) if spec else [],
        spec_accepted_per_pos=list(spec.accepted_per_pos) if spec else [],
        generation_tokens_per_s=core.throughput.rate(),
        grammar_mask_ms=sum(m.cost for m in core.structured.matchers.values()) * 1e3)


def check_admission(config, num_queued: int, num_queued_tokens: int, num_prompt_tokens: int,
                    num_requests: int = 1, grammar_in_flight_ms: float = 0.0, grammar_ms: float = 0.0) -> None:
    """Raise ``EngineOverloadedError`` when ``num_requests`` more requests of ``num_prompt_tokens``
    each (the children of an ``n > 1`` request: each waits and runs as one) would take the queue
    past ``config.max_queued_requests`` / ``max_queued_tokens``, or when their grammar masks
    (``grammar_ms``, estimated CPU ms a step, all children) would take those of the structured
    requests in flight past ``max_grammar_mask_ms_in_flight``. A request that would wait alone
    (or be the only structured one) is always admitted."""
    max_requests, max_tokens = config.max_queued_requests, config.max_queued_tokens
    if max_requests is not None and num_queued and num_queued + num_requests > max_requests:
        raise EngineOverloadedError(f"the engine is overloaded: {num_queued} requests are queued and this one "
                                    f"adds {num_requests} (max_queued_requests={max_requests}); retry later")
    tokens = num_prompt_tokens * num_requests
    if max_tokens is not None and num_queued and num_queued_tokens + tokens > max_tokens:
        raise EngineOverloadedError(f"the engine is overloaded: {num_queued_tokens} prompt tokens are queued and this "
                                    f"request adds {tokens} (max_queued_tokens={max_tokens}); retry later")
    max_grammar = config.max_grammar_mask_ms_in_flight
    if (max_grammar is not None and grammar_ms and grammar_in_flight_ms
            and grammar_in_flight_ms + grammar_ms > max_grammar):
        raise EngineOverloadedError(f"the engine is overloaded with grammar work: the structured requests in flight "
                                    f"need ~{grammar_in_flight_ms:.0f} ms of masks a step and this one "
                                    f"~{grammar_ms:.0f} ms (max_grammar_mask_ms_in_flight={max_grammar:g}); "
                                    f"retry later")


def request_grammar_ms(request) -> float:
    """The estimated CPU ms of one step's masks of ``request`` (all its children), from the
    grammar compiled for it (0 without one)."""
    matcher = request.grammar
    return matcher.cost * 1e3 * request.sampling_params.n if matcher is not None else 0.0
