"""Chained hashes of full blocks of committed tokens (the prefix-cache key).

``hash_i = hash((hash_{i-1}, tokens of block i))``: equal hashes mean equal whole prefixes.
Python's tuple hash of ints is deterministic across processes (ints are not salted) and 64 bits
wide; a collision would silently reuse a wrong block, which at 2^-64 per pair we accept, as
vLLM does with its default (non-cryptographic) hash.
"""

from __future__ import annotations

ROOT_HASH = 0x6B76_6361_6368_65  # arbitrary non-zero seed for the first block


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int, num_full_blocks: int) -> None:
    """Append hashes so that ``hashes`` covers the first ``num_full_blocks`` blocks of ``token_ids``."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_full_blocks):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
