"""Presence, frequency and repetition penalties, per verify row, on the tokens they touch only.

Formulas (vLLM's, which are OpenAI's and CTRL's/transformers'), for a row whose context holds
output-token counts ``c(v)`` and prompt tokens ``P``:

    repetition:  x(v) / r if x(v) > 0 else x(v) * r,   for v in P or c(v) > 0
    frequency:   x(v) - f * c(v)
    presence:    x(v) - p * [c(v) > 0]

applied in that order. Row j of a (1 + k)-row verify counts the request's committed output plus
drafts ``[:j]`` (what plain decoding would have committed before predicting that slot).

Only the columns of tokens that occur in the prompt, the output or the drafts can change, so a
request's m rows are worked on as one small ``[m, U]`` block over its U distinct context tokens
(``torch.unique`` of the ids, the output counted once, the draft prefix added per row), gathered
from the logits and scattered back: O(P + L + m * U) per request instead of O(m * V).
"""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, groups) -> None:
    """In place on ``logits`` ([T, V] float32).

    ``groups``: per penalized request ``(first_row, num_rows, params, prompt_ids, output_ids,
    drafts)``; its row j sees ``output_ids + drafts[:j]`` (``prompt_ids`` may be empty when the
    repetition penalty is off).
    """
    dev = logits.device
    for first, m, params, prompt_ids, output_ids, drafts in groups:
        drafts = list(drafts[:m - 1])
        n_prompt, n_out = len(prompt_ids), len(output_ids)
        ids = torch.tensor(list(prompt_ids) + list(output_ids) + drafts, dtype=torch.long, device=dev)
        if ids.numel() == 0:
            continue
        cols, where = torch.unique(ids, return_inverse=True)
        u = cols.numel()
        counts = torch.zeros(u, dtype=torch.float32, device=dev)
        counts.index_add_(0, where[n_prompt:n_prompt + n_out], torch.ones(n_out, device=dev))
        counts = counts.expand(m, u).clone()
        if drafts:  # row j gets +1 for each of drafts[:j]
            draft_cols = where[n_prompt + n_out:].tolist()
            inc = [(j, draft_cols[i]) for j in range(1, m) for i in range(j)]
            counts.index_put_((torch.tensor([j for j, _ in inc], device=dev),
                               torch.tensor([c for _, c in inc], device=dev)),
                              torch.ones(len(inc), device=dev), accumulate=True)
        seen = counts > 0
        block = logits[first:first + m]
        x = block[:, cols]
        r = params.repetition_penalty
        if r != 1.0:
            in_prompt = torch.zeros(u, dtype=torch.bool, device=dev)
            in_prompt[where[:n_prompt]] = True
            x = torch.where(seen | in_prompt, torch.where(x > 0, x / r, x * r), x)
        x = x - params.frequency_penalty * counts - params.presence_penalty * seen.to(x.dtype)
        block[:, cols] = x
