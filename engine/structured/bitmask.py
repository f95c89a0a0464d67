"""Packed token masks onto logits rows.

A bitmask row holds one bit per token id, 32 per int32 word, least significant bit first
(llguidance's and xgrammar's layout); a 0 bit forbids the token: its logit becomes ``-inf``, so
greedy argmax, the keyed race and rejection sampling all see probability 0 for it.
"""

from __future__ import annotations

import numpy as np
import torch


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 words -> ``[R, vocab_size]`` bool, True where the token is allowed."""
    words = np.ascontiguousarray(bitmask, dtype=np.int32)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits).bool()


def apply_bitmask(logits: torch.Tensor, first: int, bitmask: np.ndarray) -> None:
    """In place: ``logits[first + i, t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is 0.

    One contiguous block of rows (a request's verify rows): a slice, no gather/scatter."""
    if len(bitmask):
        forbidden = ~unpack_bitmask(bitmask, logits.shape[-1]).to(logits.device)
        logits[first:first + len(bitmask)].masked_fill_(forbidden, float("-inf"))
