"""Where a request stops: the one place that decides how many of a step's tokens a request keeps
and how it ends.

``check_stop`` decides for what the tokens alone say (EOS, stop token ids, ``max_tokens``,
``max_model_len``; a pure function) when ``Scheduler.plan_update`` builds the plan. The later
stages of the step that see more than token ids (the output processor: stop strings in the text;
structured output: a complete grammar) end a request through ``end_at``, so a cut is made one way
everywhere: the entry keeps its first ``keep`` tokens and logprobs, and says why it ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenbudget.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenbudget.scheduler.output import EngineCoreOutput


def check_stop(request: Request, tokens: list[int], max_model_len: int) -> tuple[int, RequestStatus | None, int | None]:
    """How many of ``tokens`` the request keeps, and whether they finish it.

    Returns ``(n, status, stop_reason)``: the first ``n`` tokens are committed; ``status`` is
    FINISHED_STOPPED / FINISHED_LENGTH when the n-th token ends the request (``stop_reason`` names a
    matched stop token id), else None and ``n == len(tokens)``. Order of checks per token: EOS /
    stop token (after ``min_tokens``), then ``max_tokens``, then ``max_model_len``.
    """
    num_prompt = len(request.prompt_token_ids)
    num_before = len(request.all_token_ids)
    eos = None if request.ignore_eos else request.eos_token_id
    stop_ids = request.stop_token_ids
    # Fast path (the common decode step): no token can stop the request and the lengths stay
    # below both limits after the last token, so no per-token check could fire.
    num_after = num_before + len(tokens)
    if (num_after - num_prompt < request.max_tokens and num_after < max_model_len
            and (eos is None or eos not in tokens) and (not stop_ids or stop_ids.isdisjoint(tokens))):
        return len(tokens), None, None
    for i, token in enumerate(tokens):
        num_tokens = num_before + i + 1
        num_output = num_tokens - num_prompt
        if num_output >= request.min_tokens:
            if token == eos:
                return i + 1, RequestStatus.FINISHED_STOPPED, None
            if token in stop_ids:
                return i + 1, RequestStatus.FINISHED_STOPPED, token
        if num_output >= request.max_tokens or num_tokens >= max_model_len:
            return i + 1, RequestStatus.FINISHED_LENGTH, None
    return len(tokens), None, None


def end_at(entry: EngineCoreOutput, keep: int, status: RequestStatus, stop_reason: int | str | None) -> None:
    """End ``entry``'s request after its first ``keep`` new tokens (the rest are dropped, with
    their logprobs) with ``status`` and ``stop_reason``. Changes only the plan entry: nothing is
    committed until ``Scheduler.apply_update``."""
    if keep < len(entry.new_token_ids):
        entry.new_token_ids = entry.new_token_ids[:keep]
        if entry.new_logprobs is not None:
            entry.new_logprobs = entry.new_logprobs[:keep]
    entry.finish_status, entry.stop_reason = status, stop_reason
