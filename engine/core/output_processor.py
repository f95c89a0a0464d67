"""Turns each step's committed tokens into user-facing ``RequestOutput``s.

Owns everything per request that is about text and reporting: the incremental detokenizer, stop
strings, logprobs, the cumulative logprob and the speculation counters. Per step the work is
O(new tokens) for DELTA and FINAL_ONLY requests: new tokens are appended, and an output carries
only what is new (DELTA) or nothing until the end (FINAL_ONLY, whose text is decoded once, at the
end, unless stop strings need it every step). CUMULATIVE outputs copy everything so far, by
definition.

Inside the step transaction (``engine.core.engine_core``): ``prepare(plan)`` runs before the
scheduler commits. It updates each request's state (a record of the ``states`` table,
``engine.core.request_state``: the step edits its own copy, so the table's rollback undoes it), ends
requests whose text reached a stop string by editing the plan entry (finish "stop", the tokens
cut right after the one that completed the string, so speculative and plain decoding commit the
same tokens), and returns the step's outputs. Streamed text holds back a tail that could still
become a stop string; a final output carries the complete text.

Timestamps (``RequestMetrics``): arrival comes from ``add_request``, first scheduled is the start
of the first step that ran the request (``prepare(plan, step_start)``), token times are taken when
``prepare`` sees the tokens; a rolled-back step restores them with the rest of the state.

As in vLLM, a request stopped by EOS or a stop token keeps that token in its
token ids but not in its text, unless ``include_stop_str_in_output``.

Logprobs become vLLM's ``{token_id: Logprob(logprob, rank, decoded_token)}`` dicts (the token's
string as vLLM gives it, ``engine.text.token_strings``; special tokens kept); prompt logprobs
arrive chunk by chunk and ride on the request's first output (every output for CUMULATIVE).
``n > 1``: children's outputs are gathered into their parent's (``engine.core.parallel_sampling``)
by ``gather``, after the step commits: a child's link to its parent (``children``) lives until its
final output was gathered, the parent (``parents``) until every child's was.
"""

from __future__ import annotations

import time

from tokenbudget.api.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams
from tokenbudget.engine.core.parallel_sampling import ParentRequest
from tokenbudget.engine.core.request_state import RequestState, add_text, text_drops_stop_token
from tokenbudget.engine.text.detokenizer import IncrementalDetokenizer
from tokenbudget.engine.text.token_strings import MAX_CONTEXT, token_string
from tokenbudget.engine.text.tokenizer import Tokenizer
from tokenbudget.request_table import RequestTable
from tokenbudget.scheduler.output import EngineCoreOutput
from tokenbudget.scheduler.request import FINISH_REASONS, Request, RequestStatus

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
_DEFAULT_PARAMS = SamplingParams()


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: RequestTable[RequestState] = RequestTable("output states")
        self.parents: RequestTable[ParentRequest] = RequestTable("parent requests")  # parent id -> parent
        self.children: RequestTable[tuple[ParentRequest, int]] = RequestTable("child links")  # -> (parent, index)

    @property
    def tables(self) -> tuple[RequestTable, ...]:
        """The tables of the step transaction (released with their request); the parent links
        outlive a child's release until ``gather`` has its final output."""
        return (self.states,)

    def add_request(self, request: Request, prompt: str | None = None, arrival_time: float | None = None,
                    parent: ParentRequest | None = None, index: int = 0) -> None:
        params = request.sampling_params or _DEFAULT_PARAMS
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        state = RequestState(request, prompt, params, detok,
                             bool(params.stop) or params.output_kind != FINAL_ONLY, index,
                             arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.states.set(request.request_id, state)
        if parent is not None:
            self.parents.set(parent.request_id, parent)
            self.children.set(request.request_id, (parent, index))

    def has(self, request_id: str) -> bool:
        return request_id in self.states

    def parent_id(self, request_id: str) -> str:
        """The id of the request a child belongs to (its own id for any other request)."""
        link = self.children.get(request_id)
        return link[0].request_id if link is not None else request_id

    def child_ids(self, request_id: str) -> list[str] | None:
        """The children of a parent request in flight, or None for any other id."""
        parent = self.parents.get(request_id)
        return None if parent is None else list(parent.child_ids)

    # ---- the step
    def prepare(self, plan: list[EngineCoreOutput], step_start: float | None = None) -> list[RequestOutput]:
        """Update states from the plan (may end requests at stop strings); the step's outputs.
        ``step_start``: when the step began (the first-scheduled time of its new requests)."""
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        states = self.states
        for entry in plan:
            rid = entry.request_id
            if states[rid].first_scheduled_time is None:
                states.edit(rid).first_scheduled_time = now if step_start is None else step_start
            if not entry.new_token_ids and not entry.new_prompt_logprobs:
                continue
            state = states.edit(rid)
            if entry.new_prompt_logprobs:
                self._add_prompt_logprobs(state, *entry.new_prompt_logprobs)
            if not entry.new_token_ids:
                continue
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now
            self._add_tokens(state, entry)
            detok = None
            if state.detok_each_step and state.detok is not None:
                detok = add_text(state, entry)
            out = self._output(state, entry.finish_status, entry.stop_reason, entry.new_token_ids, detok=detok)
            if out is not None:
                outputs.append(out)
        return outputs

    def final_output(self, request: Request, error: str | None = None) -> RequestOutput | None:
        """The last output of a request ended between steps (abort, error), or None for a request
        without output state; the state is released with the request (``states`` is a table of
        the engine's release path)."""
        if request.request_id not in self.states:
            return None
        return self._output(self.states.edit(request.request_id), request.status, None, [], error)

    def drop_parent(self, request_id: str) -> None:
        """Forget a parent and its children's links (all gathered, or not all added:
        ``EngineCore.add_request``)."""
        parent = self.parents.get(request_id)
        if parent is not None:
            self.parents.drop(request_id)
            for child_id in parent.child_ids:
                self.children.drop(child_id)

    def gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs replaced by their parents' (one per parent, after the others).
        Runs after the step committed: it only moves finished data around."""
        result: list[RequestOutput] = []
        touched: dict[str, ParentRequest] = {}
        for out in outputs:
            link = self.children.get(out.request_id)
            if link is None:
                result.append(out)
                continue
            parent, index = link
            parent.add(index, out)
            touched[parent.request_id] = parent
            if out.finished:
                self.children.drop(out.request_id)
        for parent in touched.values():
            merged = parent.flush()
            if merged is not None:
                result.append(merged)
            if parent.finished:
                self.drop_parent(parent.request_id)
        return result

    # ---- internals
    def _logprob_dict(self, state: RequestState, token: int, lp, context: list[int]) -> dict[int, Logprob]:
        """vLLM's entry: the token first, then the top k with their ranks 1..k; each token's
        string read after the sampled tokens ``context`` before it (``token_strings``: a part of a
        multi-byte character is "" until the token that completes it; special tokens kept; None
        without detokenization)."""
        tok = self.tokenizer if state.detok is not None else None

        def decode(t: int) -> str | None:
            return None if tok is None else token_string(tok, t, context)
        item = {token: Logprob(float(lp.logprob), int(lp.rank), decode(token))}
        for rank, (t, v) in enumerate(lp.top, 1):
            item[int(t)] = Logprob(float(v), rank, decode(int(t)))
        return item

    def _add_prompt_logprobs(self, state: RequestState, first: int, entries: list) -> None:
        """Entries for prompt tokens ``first, first + 1, ...``; ones already held (a recompute
        after preemption) are skipped."""
        have = state.prompt_logprobs
        if have is None:
            return
        skip = len(have) - first
        if skip < 0:
            raise RuntimeError(f"{state.request.request_id}: prompt logprobs from token {first}, {len(have)} held")
        prompt = state.request.prompt_token_ids
        state.prompt_logprobs = have + [self._logprob_dict(state, prompt[i], lp, prompt[max(0, i - MAX_CONTEXT):i])
                                        for i, lp in enumerate(entries[skip:], first + skip)]

    def _add_tokens(self, state: RequestState, entry: EngineCoreOutput) -> None:
        """The step's speculation counters and logprobs (new lists: see ``RequestState``)."""
        if entry.num_draft_tokens:
            state.num_draft_steps += 1
            state.num_draft_tokens += entry.num_draft_tokens
            state.num_accepted_tokens += entry.num_accepted_tokens
            per_pos = list(state.accepted_per_pos)
            if len(per_pos) < entry.num_draft_tokens:
                per_pos.extend([0] * (entry.num_draft_tokens - len(per_pos)))
            for j in range(entry.num_accepted_tokens):
                per_pos[j] += 1
            state.accepted_per_pos = tuple(per_pos)
        if state.logprobs is not None and entry.new_logprobs:
            added = []
            context = [next(iter(d)) for d in state.logprobs[-MAX_CONTEXT:]]  # the sampled tokens before
            for token, lp in zip(entry.new_token_ids, entry.new_logprobs):
                added.append(self._logprob_dict(state, token, lp, context[-MAX_CONTEXT:]))
                context.append(token)
                state.cumulative_logprob += float(lp.logprob)
            state.logprobs = state.logprobs + added

    def _output(self, state: RequestState, status: RequestStatus | None, stop_reason, new_ids: list[int],
                error: str | None = None, detok: IncrementalDetokenizer | None = None) -> RequestOutput | None:
        """The request's output after this step's ``new_ids`` (not committed yet: the scheduler
        commits after ``prepare``). ``detok``: the detokenizer already brought to this step's text."""
        finished = status is not None
        kind = state.params.output_kind
        if not finished and kind == FINAL_ONLY:
            return None
        request = state.request
        num_before = request.num_output_tokens
        if detok is None and state.detok is not None:
            detok = state.detok
            if finished and not state.detok_each_step:  # FINAL_ONLY without stop strings: decoded once, now
                tokens = request.output_token_ids + list(new_ids)
                drop = text_drops_stop_token(state, status, stop_reason, tokens[-1] if tokens else None)
                detok.add_tokens(tokens[:-1] if drop else tokens)
        text = ""
        if detok is not None:
            delta = detok.stream_delta(finished=finished, stop=state.params.stop)
            if kind == DELTA:
                text = delta
            elif finished:
                text = detok.output_text
            else:
                state.streamed_text += delta
                text = state.streamed_text
        if kind == DELTA:
            token_ids = list(new_ids)
            logprobs = state.logprobs[num_before:] if state.logprobs is not None else None
        else:
            token_ids = request.output_token_ids + list(new_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        finish_reason = FINISH_REASONS.get(status) if finished else None
        completion = CompletionOutput(index=state.index, text=text, token_ids=token_ids,
                                      cumulative_logprob=state.cumulative_logprob, logprobs=logprobs,
                                      finish_reason=finish_reason, stop_reason=stop_reason)
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None:
            if kind == DELTA and state.prompt_logprobs_sent:
                prompt_logprobs = None
            else:
                state.prompt_logprobs_sent, prompt_logprobs = True, list(prompt_logprobs)
        metrics = RequestMetrics(
            num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions, num_draft_steps=state.num_draft_steps,
            num_draft_tokens=state.num_draft_tokens, num_accepted_tokens=state.num_accepted_tokens,
            accepted_per_position=list(state.accepted_per_pos), num_output_tokens=num_before + len(new_ids),
            arrival_time=state.arrival_time, first_scheduled_time=state.first_scheduled_time,
            first_token_time=state.first_token_time, last_token_time=state.last_token_time,
            finished_time=time.monotonic() if finished else None)
        return RequestOutput(request_id=request.request_id, prompt=state.prompt,
                             prompt_token_ids=request.prompt_token_ids, prompt_logprobs=prompt_logprobs,
                             outputs=[completion], finished=finished, metrics=metrics, error=error)
