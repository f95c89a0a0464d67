"""Presence, frequency and repetition penalties, vectorized over verify rows.

Formulas (vLLM's, which are OpenAI's and CTRL's/transformers'), for a row whose context holds
output-token counts ``c(v)`` and prompt tokens ``P``:

    repetition:  x(v) / r if x(v) > 0 else x(v) * r,   for v in P or c(v) > 0
    frequency:   x(v) - f * c(v)
    presence:    x(v) - p * [c(v) > 0]

applied in that order. Row j of a (1 + k)-row verify counts the request's committed output plus
drafts ``[:j]`` (what plain decoding would have committed before predicting that slot), so the
counts are built per row: one ``bincount`` of the committed output per request, repeated for its
rows, plus one scatter of the draft prefix increments. The prompt set is a per-request mask.
"""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, groups) -> None:
    """In place on ``logits`` ([T, V] float32).

    ``groups``: per penalized request ``(first_row, num_rows, params, prompt_ids, output_ids,
    drafts)``; its row j sees ``output_ids + drafts[:j]``.
    """
    vocab, dev = logits.shape[1], logits.device
    rows: list[int] = []
    counts, prompt_masks = [], []
    pres, freq, rep = [], [], []
    for first, m, params, prompt_ids, output_ids, drafts in groups:
        rows.extend(range(first, first + m))
        base = _bincount(output_ids, vocab, dev)
        c = base.expand(m, vocab).clone()
        inc_rows = [j for j in range(1, m) for _ in range(j)]
        if inc_rows:  # row j gets +1 for each of drafts[:j]
            inc_toks = [drafts[i] for j in range(1, m) for i in range(j)]
            c.index_put_((torch.tensor(inc_rows, device=dev), torch.tensor(inc_toks, device=dev)),
                         torch.ones(len(inc_rows), device=dev), accumulate=True)
        counts.append(c)
        if params.repetition_penalty != 1.0:
            prompt_masks.append((_bincount(prompt_ids, vocab, dev) > 0).expand(m, vocab))
        else:
            prompt_masks.append(torch.zeros(1, vocab, dtype=torch.bool, device=dev).expand(m, vocab))
        pres.extend([params.presence_penalty] * m)
        freq.extend([params.frequency_penalty] * m)
        rep.extend([params.repetition_penalty] * m)
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    c = torch.cat(counts)
    seen = c > 0
    x = logits[idx]
    r = torch.tensor(rep, dtype=torch.float32, device=dev)[:, None]
    penalized = (seen | torch.cat(prompt_masks)) & (r != 1.0)
    x = torch.where(penalized, torch.where(x > 0, x / r, x * r), x)
    x = x - torch.tensor(freq, dtype=torch.float32, device=dev)[:, None] * c
    x = x - torch.tensor(pres, dtype=torch.float32, device=dev)[:, None] * seen
    logits[idx] = x


def _bincount(token_ids, vocab: int, dev: torch.device) -> torch.Tensor:
    """[V] float32 counts of ``token_ids`` (all < V)."""
    if not token_ids:
        return torch.zeros(vocab, dtype=torch.float32, device=dev)
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev)
    return torch.bincount(ids, minlength=vocab).to(torch.float32)
