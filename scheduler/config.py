"""Scheduler configuration: frozen, validated at construction.

A bad value raises ``ValueError`` naming the field. Values derived at run time (for example the
number of KV blocks a memory budget buys) are computed by their owner and passed in; they are
never written back into a config.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Policy = Literal["fcfs", "priority"]


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Limits of one engine's scheduler and the shape of its KV pool.

    max_num_batched_tokens: the token budget of one step (prefill chunks + decodes + drafts).
    max_num_seqs: most requests running at once.
    max_model_len: most tokens (prompt + output) a request may hold.
    block_size, num_blocks: the paged KV pool.
    enable_prefix_caching: reuse full blocks of committed tokens across requests.
    policy: "fcfs" (arrival order) or "priority" (lower value first, then arrival).
    long_prefill_token_threshold: if > 0, a prefill chunk is capped at this many tokens per step.
    num_lookahead_tokens: extra slots reserved per running request for a drafter that writes KV
        ahead (a draft model); 0 for drafters that keep no KV.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    policy: Policy = "fcfs"
    long_prefill_token_threshold: int = 0
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        positive = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "num_blocks")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("long_prefill_token_threshold", "num_lookahead_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.num_lookahead_tokens >= self.max_num_batched_tokens:
            raise ValueError("num_lookahead_tokens must be smaller than max_num_batched_tokens")
