"""``RequestState``: what the output processor keeps of one request, a record of its
``RequestTable`` (``tokenbudget.request_table``).

A record is never changed in place once a step is over: the output processor changes a request
through ``RequestTable.edit`` (this step's own copy), and every list in it is replaced, never
appended to, so the copy (``__copy__``: one reference per field) leaves the record a rollback
keeps exactly as it was. The output tokens themselves are not kept here: the scheduler's
``Request.all_token_ids`` holds the committed ones, and a step's new tokens are in its plan.

The detokenizer is the one mutable object a record points to, and it is part of the record: the
record's copy copies it too (``IncrementalDetokenizer.__copy__``: its token window is a list), so
the step's own record changes its own detokenizer, and the record a rollback puts back still has
the text it had when the step began. No snapshot, no restore: the table's journal is the only one.
"""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass, fields
from operator import attrgetter

from tokenbudget.api.outputs import Logprob
from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.text.detokenizer import IncrementalDetokenizer
from tokenbudget.scheduler.output import EngineCoreOutput
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.stop import end_at


@dataclass(slots=True, eq=False)
class RequestState:
    request: Request  # the scheduler's request: committed tokens, cached prompt tokens, preemptions
    prompt: str | None
    params: SamplingParams
    detok: IncrementalDetokenizer | None  # None without a tokenizer: token ids only
    detok_each_step: bool  # False: FINAL_ONLY without stop strings decodes once, at the end
    index: int = 0  # CompletionOutput.index (the child's number when n > 1)
    logprobs: list[dict[int, Logprob]] | None = None  # one per committed output token
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA: already in an output
    streamed_text: str = ""  # CUMULATIVE: the text shown so far
    num_draft_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    arrival_time: float = 0.0  # time.monotonic() seconds
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __copy__(self) -> RequestState:
        record = RequestState(*_FIELDS(self))
        if record.detok is not None:
            record.detok = copy(record.detok)
        return record


_FIELDS = attrgetter(*(f.name for f in fields(RequestState)))


def text_drops_stop_token(state: RequestState, status: RequestStatus | None, stop_reason,
                          last_token: int | None) -> bool:
    """vLLM: the EOS / stop token that ended a request is not part of its text (unless
    ``include_stop_str_in_output``); a stop string is handled by the detokenizer. Only those
    tokens: a request stopped by its grammar ending (``engine.structured``) keeps its last token."""
    if (status != RequestStatus.FINISHED_STOPPED or isinstance(stop_reason, str) or last_token is None
            or state.params.include_stop_str_in_output):
        return False
    return last_token == stop_reason if stop_reason is not None else last_token == state.request.eos_token_id


def add_text(state: RequestState, entry: EngineCoreOutput) -> IncrementalDetokenizer:
    """The step's tokens into the text, and its stop strings; the detokenizer, for the output."""
    text_before = copy(state.detok) if state.params.stop else None
    detok = state.detok
    text_ids = entry.new_token_ids
    if text_drops_stop_token(state, entry.finish_status, entry.stop_reason, text_ids[-1]):
        text_ids = text_ids[:-1]
    detok.add_tokens(text_ids)
    if text_before is not None:
        _check_stop_strings(state, entry, detok, text_before)
    return state.detok


def _check_stop_strings(state: RequestState, entry: EngineCoreOutput, detok: IncrementalDetokenizer,
                        text_before: IncrementalDetokenizer) -> None:
    """End the request at the first stop string, keeping only the tokens up to the one that
    completed it (found by replaying this step's tokens one at a time on a copy of
    ``text_before``, the detokenizer before them, which becomes the record's).

    As vLLM (its #21987): stop strings count only once the output is longer than
    ``min_tokens``; the text of the first ``min_tokens`` outputs is never searched (a stop
    string may still start in it and end after it)."""
    params = state.params
    stop, include = params.stop, params.include_stop_str_in_output
    new = entry.new_token_ids
    num_before = state.request.num_output_tokens  # committed before this step
    if num_before + len(new) <= params.min_tokens:
        detok.check_stop((), include)  # marks this text as searched
        return
    if num_before >= params.min_tokens:
        matched, _ = detok.check_stop(stop, include)
        if matched is None:
            return
    keep = len(new)
    if keep > 1 or num_before < params.min_tokens:
        detok = state.detok = text_before
        matched = None
        for keep in range(1, len(new) + 1):
            detok.add_tokens(new[keep - 1:keep])
            matched, _ = detok.check_stop(stop if num_before + keep > params.min_tokens else (), include)
            if matched is not None:
                break
        if matched is None:
            return
        drop = len(new) - keep
        if drop and state.logprobs is not None and entry.new_logprobs:
            for lp in entry.new_logprobs[keep:]:
                state.cumulative_logprob -= float(lp.logprob)
            state.logprobs = state.logprobs[:len(state.logprobs) - drop]
    end_at(entry, keep, RequestStatus.FINISHED_STOPPED, matched)
