"""Checks a new request must pass before it touches any scheduler state."""

from __future__ import annotations

from collections.abc import Mapping

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.request import Request


def validate_new_request(request: Request, config: SchedulerConfig, known: Mapping[str, Request], kv) -> None:
    """Raise ValueError naming the problem; never mutates anything."""
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
    if rid in known:
        raise ValueError(f"duplicate request_id {rid!r}: a request with this id is still running")
    check_request_fits(request, config, kv.num_blocks)


def check_request_fits(request: Request, config: SchedulerConfig, num_blocks: int) -> None:
    """The checks that depend only on the configuration (safe to run from any thread)."""
    rid = request.request_id
    prompt_len = len(request.prompt_token_ids)
    if prompt_len == 0:
        raise ValueError(f"request {rid!r}: the prompt is empty")
    if prompt_len > config.max_model_len:
        raise ValueError(f"request {rid!r}: prompt has {prompt_len} tokens, more than "
                         f"max_model_len={config.max_model_len}")
    if request.max_tokens < 1:
        raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
    if request.min_tokens < 0:
        raise ValueError(f"request {rid!r}: min_tokens must be >= 0, got {request.min_tokens}")
    if request.num_computed_tokens or request.spec_token_ids or len(request.all_token_ids) != prompt_len:
        raise ValueError(f"request {rid!r}: a new request must start with no output, drafts or computed tokens")
    # The longest the request can get, plus the drafter's lookahead, must fit in the whole pool,
    # or it would wait (or be preempted) forever.
    longest = min(prompt_len + request.max_tokens, config.max_model_len)
    longest = min(longest + config.num_lookahead_tokens, max(longest, config.max_model_len))
    need = -(-longest // config.block_size)
    if need > num_blocks:
        raise ValueError(f"request {rid!r} can never fit in the KV cache: it may need {need} blocks "
                         f"of {config.block_size} tokens, the pool has {num_blocks}")
