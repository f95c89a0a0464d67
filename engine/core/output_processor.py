"""Turns the scheduler's per-step token outputs into user-facing ``RequestOutput``s.

Owns everything per request that is about text: the incremental detokenizer, stop strings
(a stop string finishes the request: the engine aborts it in the scheduler and reports
``finish_reason="stop"``), logprobs and cumulative logprob. Streamed text holds back a tail that
could still become a stop string; the final output carries the complete text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenbudget.engine.api.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
)
from tokenbudget.engine.api.sampling_params import SamplingParams
from tokenbudget.engine.text.detokenizer import IncrementalDetokenizer
from tokenbudget.engine.text.tokenizer import Tokenizer
from tokenbudget.scheduler.output import EngineCoreOutput


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    streamed_text: str = ""
    num_draft_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        state = RequestState(request_id, prompt, prompt_token_ids, params, detok)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.states[request_id] = state

    def has(self, request_id: str) -> bool:
        return request_id in self.states

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.states.pop(request_id, None)
        return None if state is None else self._make_output(state, "abort", None, cached=None)

    def process(self, core_outputs: list[EngineCoreOutput], sched) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of this step and the ids finished by a stop string (to abort)."""
        requests = {sr.request_id: sr.request for sr in sched.scheduled}
        outputs: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for co in core_outputs:
            state = self.states.get(co.request_id)
            if state is None:
                continue
            state.token_ids.extend(co.new_token_ids)
            self._record_spec(state, co)
            if state.logprobs is not None and co.new_logprobs:
                for token, lp in zip(co.new_token_ids, co.new_logprobs):
                    entry = {token: float(lp.logprob)}
                    entry.update({int(t): float(v) for t, v in lp.top if t != token})
                    state.logprobs.append(entry)
                    state.cumulative_logprob += float(lp.logprob)
            state.detok.add_tokens(co.new_token_ids)
            finish, stop_reason = co.finish_reason, co.stop_reason
            params = state.params
            if params.stop:
                matched, _ = state.detok.check_stop(params.stop, params.include_stop_str_in_output)
                if matched is not None and finish is None:
                    finish, stop_reason = "stop", matched
                    stopped_by_string.append(co.request_id)
                elif matched is not None:
                    finish, stop_reason = "stop", matched
            request = requests.get(co.request_id)
            outputs.append(self._make_output(state, finish, stop_reason, request))
            if finish is not None:
                del self.states[co.request_id]
        return outputs, stopped_by_string

    @staticmethod
    def _record_spec(state: RequestState, co: EngineCoreOutput) -> None:
        if not co.num_draft_tokens:
            return
        state.num_draft_steps += 1
        state.num_draft_tokens += co.num_draft_tokens
        state.num_accepted_tokens += co.num_accepted_tokens
        per_pos = state.accepted_per_pos
        if len(per_pos) < co.num_draft_tokens:
            per_pos.extend([0] * (co.num_draft_tokens - len(per_pos)))
        for j in range(co.num_accepted_tokens):
            per_pos[j] += 1

    def _make_output(self, state: RequestState, finish: str | None, stop_reason, cached) -> RequestOutput:
        finished = finish is not None
        delta = state.detok.stream_delta(finished=finished, stop=state.params.stop)
        state.streamed_text += delta
        metrics = RequestMetrics(
            num_prompt_tokens=len(state.prompt_token_ids),
            num_cached_tokens=getattr(cached, "num_cached_tokens", 0),
            num_preemptions=getattr(cached, "num_preemptions", 0),
            num_draft_steps=state.num_draft_steps, num_draft_tokens=state.num_draft_tokens,
            num_accepted_tokens=state.num_accepted_tokens, accepted_per_position=list(state.accepted_per_pos))
        completion = CompletionOutput(
            text=state.detok.output_text if finished else state.streamed_text,
            token_ids=list(state.token_ids), cumulative_logprob=state.cumulative_logprob,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finish_reason=finish, stop_reason=stop_reason)
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=[completion],
                             finished=finished, metrics=metrics)
