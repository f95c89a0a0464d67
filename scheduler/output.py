"""Typed messages at the step boundaries: scheduler -> runner -> scheduler -> engine.

The step contract is immutable: the runner and sampler see a request only as a frozen
``ScheduledRequest`` built when it was scheduled, never the live ``Request`` (which a rollback or
an abort may change while they run). Everything they need travels in it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenbudget.scheduler.request import FINISH_REASONS, Request, RequestStatus


class ScheduledRequest(msgspec.Struct, frozen=True, gc=False):
    """What one request runs this step.

    The runner computes positions ``[num_computed_tokens, num_computed_tokens + num_tokens)``
    whose token ids are ``token_ids`` (the last ``len(spec_token_ids)`` of them are drafts).
    Logits are needed only when the chunk reaches the end of the committed tokens
    (``needs_sample``): at the last committed position and at every draft position.
    ``block_ids`` is the request's block table after allocation: the scheduler's own list, not a
    copy (a decode step would otherwise copy every table); it changes only in the commit or the
    rollback that follow the runner. Read it, never write it.

    For sampling: ``params`` (``SamplingParams``, or None for greedy), ``seed`` (keys the
    request's random numbers), ``num_output_tokens`` (committed outputs before this step: row j of
    a verify predicts output number ``num_output_tokens + j``), ``banned_token_ids`` (forbidden
    while the request is short of ``min_tokens``) and ``spec_probs`` (the drafter's ``[k, V]``
    probabilities of the scheduled drafts, or None: q(x) = 1 for the drafted token).

    For row preparation and prompt logprobs: ``all_token_ids`` is the request's committed prompt +
    output, the scheduler's own list like ``block_ids`` (it grows only in the commit that follows
    the runner; read it, never write it), ``num_prompt_tokens`` its prompt length and
    ``bad_words_token_ids`` the token sequences of ``params.bad_words``.
    """

    request_id: str
    num_computed_tokens: int
    token_ids: list[int]
    spec_token_ids: list[int]
    block_ids: list[int]
    is_new: bool
    needs_sample: bool
    params: Any = None
    seed: int = 0
    num_output_tokens: int = 0
    banned_token_ids: tuple[int, ...] = ()
    spec_probs: Any = None
    all_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def scheduled_chunk(request: Request, start: int, end: int, block_ids: list[int], *,
                    is_new: bool) -> ScheduledRequest:
    """The one builder from a live ``Request``: positions ``[start, end)`` of its committed tokens
    and scheduled drafts. A chunk that ends short of the committed tokens samples nothing (a
    partial prefill); one that reaches the end samples, and carries the drafts it covers with their
    probabilities and, while the request is short of ``min_tokens``, the tokens it may not emit."""
    all_ids = request.all_token_ids
    num_committed = len(all_ids)
    num_prompt = len(request.prompt_token_ids)
    if end < num_committed:
        return ScheduledRequest(request_id=request.request_id, num_computed_tokens=start,
                                token_ids=all_ids[start:end], spec_token_ids=[], block_ids=block_ids,
                                is_new=is_new, needs_sample=False, params=request.sampling_params,
                                seed=request.seed, all_token_ids=all_ids, num_prompt_tokens=num_prompt)
    spec = request.spec_token_ids[:end - num_committed]
    num_output = num_committed - num_prompt
    return ScheduledRequest(
        request_id=request.request_id, num_computed_tokens=start, token_ids=all_ids[start:] + spec,
        spec_token_ids=spec, block_ids=block_ids, is_new=is_new, needs_sample=True,
        params=request.sampling_params, seed=request.seed, num_output_tokens=num_output,
        banned_token_ids=request.min_tokens_banned if num_output < request.min_tokens else (),
        spec_probs=request.spec_probs[:len(spec)] if spec and request.spec_probs is not None else None,
        all_token_ids=all_ids, num_prompt_tokens=num_prompt, bad_words_token_ids=request.bad_words_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch, in batch order (running requests first, then newly admitted)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Requests preempted by this step's scheduling (they left the running set; KV freed).
    preempted_request_ids: list[str] = field(default_factory=list)
    num_lookahead_tokens: int = 0
    # Grammar masks, computed by the core after ``schedule()`` (``engine.structured``): request
    # id -> int32 ``[r, W]`` packed bitmask rows for that request's first r sampling rows (rows
    # past r, and requests without an entry, are unmasked); or a ``Future`` of them while they are
    # computed beside the forward (``engine.structured.mask_overlap``). The runner only applies
    # them (``grammar_masks``); a mask that cannot be computed is a ``RequestFault`` of its request.
    grammar_bitmask: dict[str, Any] | Future | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def grammar_masks(self) -> dict[str, Any] | None:
        """The grammar masks, waited for when they are computed beside the forward (raising
        what computing them raised: ``RequestFault``, ``MaskDeferral``)."""
        masks = self.grammar_bitmask
        return masks.result() if isinstance(masks, Future) else masks


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled request (same order as ``SchedulerOutput.scheduled``): the tokens the step
    committed. For a request that sampled, that is its accepted drafts followed by exactly one
    bonus/recovered token; for a partial prefill chunk it is empty.

    ``logprobs[i]``, when requested, holds one entry per committed token (opaque to the scheduler).
    ``prompt_logprobs``: request id -> ``(first prompt position, entries)`` for the prompt tokens
    whose logprobs this step computed (opaque to the scheduler).
    ``aux_hidden_states``: with aux layers set on the runner's model (EAGLE-3 taps,
    ``engine/model/aux_states.py``), the target's states at those layers, a ``torch.Tensor``
    ``[total_num_scheduled_tokens, len(layers) * hidden]`` float32 with one row per scheduled
    token in the step's flat order (request by request as in ``SchedulerOutput.scheduled``, each
    request's tokens in position order, drafts included); None without taps. Opaque here (this
    layer does not import torch); computed by this step's forward, so a retried step has its own.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list] | None = None
    prompt_logprobs: dict[str, tuple[int, list]] | None = None
    aux_hidden_states: Any = None


class EngineCoreOutput(msgspec.Struct, gc=False):
    """What a step does for one request: ``Scheduler.plan_update`` builds it without changing
    anything, the output processor may end the request at a stop string (``finish_status``,
    ``stop_reason``, fewer ``new_token_ids``), and ``Scheduler.apply_update`` commits it.

    ``gc=False``: one per request per step, holding only ids and numbers (no cycles possible);
    untracked, they do not push the cyclic GC into full collections over every token list."""

    request_id: str
    new_token_ids: list[int]
    finish_status: RequestStatus | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    new_logprobs: list | None = None
    new_prompt_logprobs: tuple[int, list] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_status is not None

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.finish_status) if self.finish_status is not None else None
