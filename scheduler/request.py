"""The scheduler's view of one request.

The only scheduling state is ``all_token_ids`` (prompt + output), ``spec_token_ids`` (drafts for
the next step) and ``num_computed_tokens`` (positions whose KV is in the cache). Everything else
here is either immutable input (limits, priority) or bookkeeping for outputs and metrics.
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

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """One request inside the scheduler.

    ``sampling_params`` is opaque to the scheduler (the runner and sampler read it); the stop
    criteria the scheduler applies are copied into plain fields at construction.
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
    # Per-request speculation cap (None = engine default, 0 = never speculate).
    max_spec_tokens: int | None = None

    all_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | None = None
    # Prompt tokens served from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculation counters for this request.
    num_draft_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

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
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
