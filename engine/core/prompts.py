"""Prompt inputs -> scheduler ``Request``s, with the checks a bad prompt must fail."""

from __future__ import annotations

from typing import Union

from tokenbudget.engine.api.sampling_params import SamplingParams
from tokenbudget.engine.text.tokenizer import Tokenizer
from tokenbudget.scheduler.request import Request

PromptInput = Union[str, list[int], dict]


def tokenize_prompt(prompt: PromptInput, tokenizer: Tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """``str`` -> encoded; ``list[int]`` -> token ids; ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt and prompt["prompt_token_ids"] is not None:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        return prompt, ids
    if isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty (no token ids)")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt token id {t!r} is out of range [0, {vocab_size})")
        return None, ids
    raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")


def make_request(request_id: str, prompt: PromptInput, params: SamplingParams, priority: int,
                 tokenizer: Tokenizer, vocab_size: int) -> tuple[str | None, Request]:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int, got {priority!r}")
    text, ids = tokenize_prompt(prompt, tokenizer, vocab_size)
    stop_ids = set(params.stop_token_ids)
    eos = tokenizer.eos_token_id
    if not params.ignore_eos:
        stop_ids.update(t for t in tokenizer.eos_token_ids if t != eos)
    request = Request(request_id, ids, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                      eos_token_id=eos, stop_token_ids=frozenset(stop_ids), ignore_eos=params.ignore_eos,
                      priority=priority, sampling_params=params,
                      max_spec_tokens=params.num_speculative_tokens)
    return text, request
