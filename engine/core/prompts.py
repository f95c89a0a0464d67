"""Prompt inputs -> scheduler ``Request``s, with the checks a bad prompt must fail.

Every check runs before the request touches any engine state, and each failure is a
``ValueError`` naming what is wrong: an empty prompt, a token id out of the vocabulary or not an
integer (numpy integers are accepted), text that cannot be encoded (a lone surrogate), a bad
request id or priority.
"""

from __future__ import annotations

import operator
from typing import Union

from tokenbudget.engine.api.sampling_params import SamplingParams
from tokenbudget.engine.text.tokenizer import Tokenizer
from tokenbudget.scheduler.request import Request

PromptInput = Union[str, list[int], dict]


def _token_ids(prompt, vocab_size: int) -> list[int]:
    ids = []
    for t in prompt:
        if isinstance(t, bool):
            raise ValueError(f"prompt token id {t!r} is not an integer")
        try:
            t = operator.index(t)  # int, numpy integers, 0-d integer tensors
        except TypeError:
            raise ValueError(f"prompt token id {t!r} is not an integer") from None
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t} is out of range [0, {vocab_size})")
        ids.append(t)
    if not ids:
        raise ValueError("prompt is empty (no token ids)")
    return ids


def _encode(text: str, tokenizer: Tokenizer) -> list[int]:
    if not text:
        raise ValueError("prompt is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"prompt is not valid text: {exc.reason} at position {exc.start}") from None
    ids = tokenizer.encode(text, add_special_tokens=True)
    if not ids:
        raise ValueError("prompt is empty after tokenization")
    return ids


def tokenize_prompt(prompt: PromptInput, tokenizer: Tokenizer | None, vocab_size: int) -> tuple[str | None, list[int]]:
    """``str`` -> encoded; token ids -> checked; ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``."""
    if isinstance(prompt, dict):
        if prompt.get("prompt_token_ids") is not None:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids")
        return prompt, _encode(prompt, tokenizer)
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
    return None, _token_ids(prompt, vocab_size)


def make_request(request_id: str, prompt: PromptInput, params: SamplingParams, priority: int,
                 tokenizer: Tokenizer | None, vocab_size: int) -> tuple[str | None, Request]:
    """A ``Request`` for the scheduler (its ``seed`` is ``params.seed``, else 0 until the engine
    assigns one when it accepts the request)."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int, got {priority!r}")
    text, ids = tokenize_prompt(prompt, tokenizer, vocab_size)
    for t in params.stop_token_ids:
        if t >= vocab_size:
            raise ValueError(f"stop_token_ids: {t} is out of the vocabulary [0, {vocab_size})")
    stop_ids = set(params.stop_token_ids)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if not params.ignore_eos and tokenizer is not None:
        stop_ids.update(t for t in tokenizer.eos_token_ids if t != eos)
    request = Request(request_id, ids, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                      eos_token_id=eos, stop_token_ids=frozenset(stop_ids), ignore_eos=params.ignore_eos,
                      priority=priority, sampling_params=params,
                      seed=params.seed if params.seed is not None else 0,
                      max_spec_tokens=params.num_speculative_tokens)
    return text, request
