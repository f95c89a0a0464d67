"""The draft vocabulary: the target ids the head can propose, and the maps both ways.

EAGLE-3 shrinks the head's LM head to the most frequent target ids of the training responses
(what the target actually says), so its cost and size do not scale with the target's vocabulary.
A token outside it can never be drafted, so ``coverage`` (the share of response tokens inside) is
an upper bound on per-position acceptance.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def frequent_ids(responses: Iterable[list[int]], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids over ``responses`` (ties: lower id first), ascending; when
    fewer distinct ids occur, the rest are the lowest unused ids (the table keeps its size)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in responses:
        counts += torch.bincount(torch.as_tensor(ids, dtype=torch.int64), minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]), dtype=torch.int64)


def target_to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int64: the draft id of each target id, -1 outside the draft vocabulary."""
    out = torch.full((vocab_size,), -1, dtype=torch.int64)
    out[draft_ids] = torch.arange(draft_ids.numel())
    return out


def coverage(responses: Iterable[list[int]], draft_ids: torch.Tensor, vocab_size: int) -> float:
    """Share of response tokens inside the draft vocabulary."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[draft_ids] = True
    hit = total = 0
    for ids in responses:
        t = torch.as_tensor(ids, dtype=torch.int64)
        hit += int(inside[t].sum())
        total += t.numel()
    return hit / max(total, 1)
