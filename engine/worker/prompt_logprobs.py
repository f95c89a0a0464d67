"""Prompt logprobs: the raw model's logprob of each prompt token given the tokens before it.

A chunk of a request that asked for ``prompt_logprobs`` computes positions ``[nc, nc + n)``; the
hidden state at position p predicts token p + 1, so the chunk yields the entries of prompt tokens
``nc + 1 .. min(nc + n, P - 1)`` (P prompt tokens; position P - 1 predicts the first output,
which the sampler handles). Such a request never reads the prefix cache
(``Request.skip_reading_prefix_cache``), so every prompt position is computed once, in order;
after a preemption the recomputed entries come again and the output processor keeps the first.
Logits are computed only for these rows, in slices, so a long prompt never holds [P, V] logits.
"""

from __future__ import annotations

import torch

from tokenbudget.engine.worker.sampler import TokenLogprob, token_logprobs
from tokenbudget.scheduler.output import SchedulerOutput

_ROWS_PER_SLICE = 256


def wants_prompt_logprobs(sched: SchedulerOutput) -> bool:
    return any(_span(sr) for sr in sched.scheduled)


def _span(sr) -> tuple[int, int] | None:
    """Positions ``[start, end)`` of this chunk whose logits give prompt logprobs, or None."""
    params = sr.params
    if params is None or params.prompt_logprobs is None or sr.all_token_ids is None:
        return None
    start, end = sr.num_computed_tokens, min(sr.num_computed_tokens + sr.num_tokens, sr.num_prompt_tokens - 1)
    return (start, end) if start < end else None


def compute_prompt_logprobs(model, hidden: torch.Tensor, sched: SchedulerOutput,
                            qo_indptr: list[int]) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """request id -> (index of its first prompt token covered, one ``TokenLogprob`` per token)."""
    result: dict[str, tuple[int, list[TokenLogprob]]] = {}
    for i, sr in enumerate(sched.scheduled):
        span = _span(sr)
        if span is None:
            continue
        start, end = span
        entries: list[TokenLogprob] = []
        for a in range(start, end, _ROWS_PER_SLICE):
            b = min(a + _ROWS_PER_SLICE, end)
            flat = qo_indptr[i] + (a - start)
            logits = model.compute_logits(hidden[flat:flat + (b - a)])
            entries.extend(token_logprobs(logits, sr.all_token_ids[a + 1:b + 1], sr.params.prompt_logprobs))
        result[sr.request_id] = (start + 1, entries)
    return result
