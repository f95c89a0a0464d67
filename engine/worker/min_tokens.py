"""``min_tokens``: forbid EOS and stop token ids until a request has produced enough tokens.

Applied to the target's logits before sampling/verification, per position: with k drafts, logit
row j predicts output token number ``num_output + j``, so rows before ``min_tokens`` are masked.
Masking p (not just ignoring a sampled EOS) keeps speculative verification exact: the draft is
judged against the same distribution plain decoding samples from.
"""

from __future__ import annotations

import torch

from tokenbudget.scheduler.output import SchedulerOutput


def apply_min_tokens(logits: torch.Tensor, sched: SchedulerOutput, num_samples: list[int]) -> None:
    """Mask in place. ``num_samples[i]`` is 1 + k for a sampling request, 0 otherwise."""
    row = 0
    vocab = logits.shape[-1]
    for sr, m in zip(sched.scheduled, num_samples):
        if not m:
            continue
        request = sr.request
        remaining = request.min_tokens - request.num_output_tokens
        if remaining > 0:
            banned = set(request.stop_token_ids)
            if request.eos_token_id is not None and not request.ignore_eos:
                banned.add(request.eos_token_id)
            ids = [t for t in banned if 0 <= t < vocab]
            if ids:
                rows = min(remaining, m)
                logits[row:row + rows, ids] = float("-inf")
        row += m
