"""Drafts on their way into the scheduler: one carrier and one rule for how many are useful.

``DraftBatch`` is the only way drafts (and a model drafter's probabilities) reach the scheduler,
through ``Scheduler.add_drafts`` (``set_drafts``), which cuts every list to ``draft_limit``. Proposers and the
draft-length controller use the same function to size what they propose, so nothing is drafted
that would be cut.

How many drafts are useful: verifying k drafts emits between 1 and k + 1 tokens (accepted drafts
plus one bonus/recovered token). A request with ``r = max_tokens - num_output_tokens`` tokens left
gains nothing from more than ``r - 1`` drafts: if all are accepted the bonus token completes it.
The same holds for the model length: with ``L = len(all_token_ids)`` at most
``max_model_len - L - 1`` drafts are useful, so the drafts' KV positions and the bonus token stay
inside the model length. ``Request.max_spec_tokens`` (0 = never speculate) caps it further.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenbudget.kv_cache.journal import UndoLog
from tokenbudget.scheduler.request import Request, RequestStatus


def draft_limit(request: Request, max_model_len: int, k: int | None = None) -> int:
    """Most drafts worth verifying for ``request`` next step (>= 0), at most ``k`` if given."""
    num_tokens = len(request.all_token_ids)
    limit = max_model_len - num_tokens - 1
    left = request.max_tokens - (num_tokens - len(request.prompt_token_ids)) - 1  # output tokens left - 1
    if left < limit:
        limit = left
    if request.max_spec_tokens is not None and request.max_spec_tokens < limit:
        limit = request.max_spec_tokens
    if k is not None and k < limit:
        limit = k
    return limit if limit > 0 else 0


@dataclass(slots=True)
class DraftBatch:
    """One step's drafts: ``token_ids[i]`` for request ``request_ids[i]``; ``probs`` is None or,
    per request, None or the drafter's ``[len(token_ids[i]), V]`` probabilities."""

    request_ids: list[str]
    token_ids: list[list[int]]
    probs: list[Any] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.request_ids) or (
                self.probs is not None and len(self.probs) != len(self.request_ids)):
            raise ValueError(f"DraftBatch: {len(self.request_ids)} requests, {len(self.token_ids)} draft "
                             f"lists, {None if self.probs is None else len(self.probs)} prob entries")

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def set_drafts(request_of: Callable[[str], Request | None], batch: DraftBatch, max_model_len: int,
               journal: UndoLog) -> None:
    """Give each running request of ``batch`` its drafts (and their probabilities), cut to
    ``draft_limit``; the lists they replace go to ``journal`` (replaced, never changed in place:
    ``Request.spec_token_ids``)."""
    probs = batch.probs if batch.probs is not None else [None] * len(batch.request_ids)
    previous: list = []  # request, its drafts, their probs, ...: flat (no tuple per request for the GC)
    for rid, tokens, q in zip(batch.request_ids, batch.token_ids, probs):
        request = request_of(rid)
        if request is None or request.status != RequestStatus.RUNNING:
            continue
        n = draft_limit(request, max_model_len)
        if n > len(tokens):
            n = len(tokens)
        previous += (request, request.spec_token_ids, request.spec_probs)
        request.spec_token_ids = tokens[:n]
        request.spec_probs = q[:n] if q is not None and n else None
    journal.record(_undo_drafts, previous)


def _undo_drafts(dirty: bool, previous: list) -> None:
    for i in range(0, len(previous), 3):
        request = previous[i]
        request.spec_token_ids, request.spec_probs = previous[i + 1], previous[i + 2]
