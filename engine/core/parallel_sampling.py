"""``n > 1``: one user request fanned out into n child requests, gathered back into one output.

As in vLLM V1: child i is an ordinary request with id ``f"{i}_{parent_id}"`` and the parent's
parameters with ``n = 1``. A user seed gives child i the seed ``seed + i`` (mod 2**64), so every
sample is reproducible on its own; an unseeded parent's children draw theirs from the parent's
engine-assigned seed (``mix64(seed, i)``). Only child 0 computes ``prompt_logprobs`` (it reads no
prefix cache); children 1.. wait for child 0 to compute the prompt
(``Request.shares_prefix_with``) and then get its full blocks from the prefix cache instead of
recomputing them.

Outputs: each step's child outputs for one parent become one ``RequestOutput`` with the parent's
id, its completions told apart by ``CompletionOutput.index``:

* CUMULATIVE: the latest completion of every child that has produced anything;
* DELTA: the completions of the children with something new this step;
* FINAL_ONLY: nothing until every child finished, then all n completions in index order.

``finished`` is True once every child finished. Metrics are summed over the children. Gathering
runs after the step commits (``EngineCore``), so it never needs to be undone.
"""

from __future__ import annotations

import dataclasses

import msgspec

from tokenbudget.api.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenbudget.api.sampling_params import RequestOutputKind
from tokenbudget.engine.worker.keyed_random import mix64
from tokenbudget.scheduler.request import Request

_SEED_MOD = 2**64


class ParentRequest:
    def __init__(self, request: Request) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.n = params.n
        self.kind = params.output_kind
        self.child_ids = [f"{i}_{request.request_id}" for i in range(self.n)]
        self.live = set(range(self.n))  # children not finished yet
        self._latest: dict[int, CompletionOutput] = {}
        self._pending: dict[int, CompletionOutput] = {}  # this step's completions
        self._metrics: dict[int, RequestMetrics] = {}
        self._prompt_logprobs = None
        self._prompt_logprobs_sent = False
        self._last: RequestOutput | None = None
        self._error: str | None = None

    def make_children(self, request: Request) -> list[Request]:
        """The n child requests (child i >= 1 waits for child 0's prompt: see the module doc)."""
        params = request.sampling_params
        children: list[Request] = []
        for i, child_id in enumerate(self.child_ids):
            seed = (params.seed + i) % _SEED_MOD if params.seed is not None else None
            child_params = msgspec.structs.replace(
                params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            children.append(dataclasses.replace(
                request, request_id=child_id, sampling_params=child_params,
                seed=seed if seed is not None else mix64(request.seed, i), all_token_ids=[], spec_token_ids=[],
                skip_reading_prefix_cache=request.skip_reading_prefix_cache and i == 0,
                shares_prefix_with=children[0] if i else None))
        return children

    @property
    def finished(self) -> bool:
        return not self.live

    def add(self, index: int, out: RequestOutput) -> None:
        """One child's output of this step (its single completion carries ``index``)."""
        completion = out.outputs[0]
        if completion.finished:
            self.live.discard(index)
        self._pending[index] = completion
        if self.kind != RequestOutputKind.DELTA:
            self._latest[index] = completion
        if out.metrics is not None:
            self._metrics[index] = out.metrics
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = out.prompt_logprobs
        self._error = self._error or out.error
        self._last = out

    def flush(self) -> RequestOutput | None:
        """The parent's output for this step's child outputs, or None (FINAL_ONLY, not done)."""
        pending, self._pending = self._pending, {}
        finished = self.finished
        if self.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        chosen = pending if self.kind == RequestOutputKind.DELTA else self._latest
        prompt_logprobs = self._prompt_logprobs
        if self.kind == RequestOutputKind.DELTA:
            prompt_logprobs = None if self._prompt_logprobs_sent else prompt_logprobs
            self._prompt_logprobs_sent = self._prompt_logprobs_sent or prompt_logprobs is not None
        last = self._last
        return RequestOutput(request_id=self.request_id, prompt=last.prompt, prompt_token_ids=last.prompt_token_ids,
                             prompt_logprobs=prompt_logprobs, outputs=[chosen[i] for i in sorted(chosen)],
                             finished=finished, metrics=_sum_metrics(self._metrics.values()), error=self._error)


def _sum_metrics(parts) -> RequestMetrics | None:
    parts = list(parts)
    if not parts:
        return None
    per_pos: list[int] = []
    for m in parts:
        per_pos.extend([0] * (len(m.accepted_per_position) - len(per_pos)))
        for j, a in enumerate(m.accepted_per_position):
            per_pos[j] += a
    total = {f: sum(getattr(m, f) for m in parts) for f in ("num_cached_tokens", "num_preemptions", "num_draft_steps",
                                                            "num_draft_tokens", "num_accepted_tokens")}
    return RequestMetrics(num_prompt_tokens=parts[0].num_prompt_tokens, accepted_per_position=per_pos, **total)
