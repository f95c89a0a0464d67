"""Typed messages at the step boundaries: scheduler -> runner -> scheduler -> engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenbudget.scheduler.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """What one request runs this step.

    The runner computes positions ``[num_computed_tokens, num_computed_tokens + num_tokens)``
    whose token ids are ``token_ids`` (the last ``len(spec_token_ids)`` of them are drafts).
    Logits are needed only when the chunk reaches the end of the committed tokens
    (``needs_sample``): at the last committed position and at every draft position.
    ``block_ids`` is the request's whole block table after allocation (shared list; read only).
    """

    request: Request
    num_computed_tokens: int
    num_tokens: int
    token_ids: list[int]
    spec_token_ids: list[int]
    block_ids: list[int]
    is_new: bool
    needs_sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch, in batch order (running requests first, then newly admitted)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Requests that left the running set since the previous step (runner may drop their state).
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    num_lookahead_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled request (same order as ``SchedulerOutput.scheduled``): the tokens the step
    committed. For a request that sampled, that is its accepted drafts followed by exactly one
    bonus/recovered token; for a partial prefill chunk it is empty.

    ``logprobs[i]``, when requested, holds one entry per committed token (opaque to the scheduler).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What a step did for one request, returned by ``Scheduler.update_from_output``."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    new_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
