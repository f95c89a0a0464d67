"""Packed token masks onto logits rows.

A bitmask row holds one bit per token id, 32 per int32 word, least significant bit first
(llguidance's and xgrammar's layout); a 0 bit forbids the token: its logit becomes ``-inf``, so
greedy argmax, the keyed race and rejection sampling all see probability 0 for it.
"""

from __future__ import annotations

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 words -> ``[R, vocab_size]`` bool, True where the token is allowed."""
    words = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32))
    bits = (words.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """In place: ``logits[rows[i], t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is 0."""
    if not rows:
        return
    allowed = unpack_bitmask(bitmask, logits.shape[-1]).to(logits.device)
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
