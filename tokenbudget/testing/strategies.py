"""Hypothesis strategies for scheduler configurations and workloads."""

from __future__ import annotations

from hypothesis import strategies as st

from tokenbudget.scheduler.config import SchedulerConfig


@st.composite
def scheduler_configs(draw, max_blocks: int = 48) -> SchedulerConfig:
    """Small, tight configurations: tiny budgets and pools make chunking and preemption common."""
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 96))
    min_blocks = -(-max_model_len // block_size) + 1
    num_blocks = draw(st.integers(min_blocks, max(max_blocks, min_blocks + 1)))
    lookahead = draw(st.sampled_from([0, 0, 0, 1, 3]))
    return SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(lookahead + 1, 128)),
        max_num_seqs=draw(st.integers(1, 12)),
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 16])),
        num_lookahead_tokens=lookahead,
    )


def request_specs(vocab_size: int, max_prompt: int):
    """(prompt_suffix, use_shared_prefix, priority, max_tokens, min_tokens, ignore_eos, stop_ids)."""
    return st.fixed_dictionaries({
        "prompt": st.lists(st.integers(1, vocab_size - 1), min_size=1, max_size=max(1, max_prompt)),
        "shared_prefix": st.sampled_from([0, 1, 2, 3]),
        "priority": st.integers(-2, 2),
        "max_tokens": st.integers(1, 40),
        "min_tokens": st.sampled_from([0, 0, 0, 2]),
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(1, vocab_size - 1), max_size=2),
    })
