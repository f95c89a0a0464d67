"""Presence, frequency and repetition penalties, per verify row, on the tokens they touch only.

Formulas (vLLM's, which are OpenAI's and CTRL's/transformers'), for a row whose context holds
output-token counts ``c(v)`` and prompt tokens ``P``:

    repetition:  x(v) / r if x(v) > 0 else x(v) * r,   for v in P or c(v) > 0
    frequency:   x(v) - f * c(v)
    presence:    x(v) - p * [c(v) > 0]

applied in that order. Row j of a (1 + k)-row verify counts the request's committed output plus
drafts ``[:j]`` (what plain decoding would have committed before predicting that slot).

Only the columns of tokens in a request's prompt, output or drafts can change, so the work is
on (row, distinct context token) entries, never on whole [rows, V] rows, and it is one batch of
tensor operations for all requests (no per-request kernels): ``torch.unique`` of
``request * V + token`` over every context token gives each request's distinct tokens (sorted,
so a request's are contiguous); the output is counted once per request; its rows are the
entries ``(row j, distinct token u)``; the draft prefix adds its counts per row; the entries'
logits are gathered, penalized and scattered back. Cost O(sum of context lengths + entries).
"""

from __future__ import annotations

import numpy as np
import torch


def apply_penalties(logits: torch.Tensor, groups) -> None:
    """In place on ``logits`` ([T, V] float32, contiguous).

    ``groups``: per penalized request ``(first_row, num_rows, params, prompt_ids, output_ids,
    drafts)``; its row j sees ``output_ids + drafts[:j]`` (``prompt_ids`` may be empty when the
    repetition penalty is off).
    """
    dev, vocab = logits.device, logits.shape[1]
    parts, kinds, draft_at = [], [], []  # draft_at: (group, row j, index in keys_flat) per draft row j counts
    offset = 0
    for g, (_, m, _, prompt, output, drafts) in enumerate(groups):
        drafts = list(drafts[:m - 1])
        start = offset + len(prompt) + len(output)
        parts.append(np.asarray(list(prompt) + list(output) + drafts, dtype=np.int64) + g * vocab)
        kinds.append(np.repeat(np.array([0, 1, 2], dtype=np.int8), (len(prompt), len(output), len(drafts))))
        draft_at += [(g, j, start + i) for j in range(1, m) for i in range(j)]
        offset = start + len(drafts)
    keys_flat = np.concatenate(parts)
    if not keys_flat.size:
        return
    kind = torch.from_numpy(np.concatenate(kinds)).to(dev)
    keys, where = torch.unique(torch.from_numpy(keys_flat).to(dev), return_inverse=True)
    num_groups = len(groups)
    key_group, key_token = keys // vocab, keys % vocab
    num_keys = torch.bincount(key_group, minlength=num_groups)  # U_g
    key_start = torch.cumsum(num_keys, 0) - num_keys
    out_count = torch.zeros(keys.numel(), dtype=torch.float32, device=dev)
    out_where = where[kind == 1]
    out_count.index_add_(0, out_where, torch.ones(out_where.numel(), device=dev))
    in_prompt = torch.zeros(keys.numel(), dtype=torch.bool, device=dev)
    in_prompt[where[kind == 0]] = True
    # Entries (row r, key u of r's group), row after row: r's entries are its group's keys.
    info = torch.tensor([(f, m, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                         for f, m, p, *_ in groups], dtype=torch.float64, device=dev)
    rows_per_group = info[:, 1].long()
    row_group = torch.repeat_interleave(torch.arange(num_groups, device=dev), rows_per_group)  # [R]
    group_first_row = torch.cumsum(rows_per_group, 0) - rows_per_group
    row_abs = info[:, 0].long()[row_group] + torch.arange(row_group.numel(), device=dev) - group_first_row[row_group]
    row_keys = num_keys[row_group]
    row_entry_start = torch.cumsum(row_keys, 0) - row_keys
    entry_row = torch.repeat_interleave(torch.arange(row_group.numel(), device=dev), row_keys)  # [E]
    u = torch.arange(entry_row.numel(), device=dev) - (row_entry_start - key_start[row_group])[entry_row]
    counts = out_count[u]
    if draft_at:
        g, jj, pos = torch.tensor(draft_at, dtype=torch.long, device=dev).unbind(1)
        entry = row_entry_start[group_first_row[g] + jj] + where[pos] - key_start[g]
        counts.index_add_(0, entry, torch.ones(entry.numel(), device=dev))
    flat = row_abs[entry_row] * vocab + key_token[u]
    x = logits.view(-1).index_select(0, flat)
    rep, freq, pres = (info[:, c].to(torch.float32)[row_group][entry_row] for c in (2, 3, 4))
    seen = counts > 0
    penalized = (seen | in_prompt[u]) & (rep != 1.0)
    x = torch.where(penalized, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * seen
    logits.view(-1).scatter_(0, flat, x)
