"""The scheduler's view of one request.

The only scheduling state is ``all_token_ids`` (prompt + output), ``spec_token_ids`` (drafts for
the next step, with the drafter's probabilities in ``spec_probs`` when it has them) and
``num_computed_tokens`` (positions whose KV is in the cache). Everything else here is immutable
input (limits, priority, sampling parameters and seed) or bookkeeping read by outputs.

``spec_token_ids`` and ``spec_probs`` are always *replaced*, never mutated in place: a step's
journal keeps the old list and puts it back on rollback.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One request inside the scheduler.

    ``sampling_params`` is opaque to the scheduler (the runner and sampler read it from the step's
    ``ScheduledRequest``); the stop criteria the scheduler applies are copied into plain fields at
    construction. ``seed`` keys the request's random numbers (``params.seed``, or one the engine
    drew at admission), so a request's tokens depend on nothing but its own history.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    min_tokens: int = 0
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0
    arrival_index: int = 0
    sampling_params: Any = None
    seed: int = 0
    # Per-request speculation cap (None = engine default, 0 = never speculate).
    max_spec_tokens: int | None = None
    # ``SamplingParams.bad_words`` as token id sequences (tokenized once, at add_request).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Compute every prompt position (prompt logprobs need their logits): no prefix-cache hits.
    skip_reading_prefix_cache: bool = False
    # A sibling of the same prompt (``n > 1``): this request is not admitted while that one is
    # still computing its prompt, so it finds the prompt's blocks in the prefix cache.
    shares_prefix_with: Request | None = None
    # The request's grammar matcher when it was compiled before ``add_request`` (off the thread
    # that steps the engine); opaque here, taken over by ``engine.structured`` at admission.
    grammar: Any = None

    all_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: Any = None  # [len(spec_token_ids), V] drafter probabilities, or None
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Prompt tokens served from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Every committed token but the last has KV: the next step samples (or verifies drafts)."""
        return self.num_computed_tokens == len(self.all_token_ids) - 1

    @property
    def min_tokens_banned(self) -> tuple[int, ...]:
        """Token ids the sampler must forbid while fewer than ``min_tokens`` outputs exist."""
        if self.num_output_tokens >= self.min_tokens:
            return ()
        banned = set(self.stop_token_ids)
        if self.eos_token_id is not None and not self.ignore_eos:
            banned.add(self.eos_token_id)
        return tuple(sorted(banned))

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def waits_for_prefix(self) -> bool:
        """Its sibling is queued or has not committed the shared prompt yet (no output token:
        ``num_computed_tokens`` runs ahead of the commit, the prefix cache does not)."""
        src = self.shares_prefix_with
        return (src is not None and src.status in (RequestStatus.WAITING, RequestStatus.RUNNING)
                and len(src.all_token_ids) == len(src.prompt_token_ids))

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
