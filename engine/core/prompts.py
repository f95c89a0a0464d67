"""Prompt inputs -> scheduler ``Request``s, with the checks a bad prompt must fail.

Every check runs before the request touches any engine state, and each failure is a
``ValueError`` naming what is wrong: an empty prompt, a token id out of the vocabulary or not an
integer (numpy integers are accepted), text that cannot be encoded (a lone surrogate), a bad
request id or priority, and sampling parameters the model or engine cannot honour (a token id of
``stop_token_ids`` / ``logit_bias`` / ``allowed_token_ids`` / ``bad_words`` out of the
vocabulary, more ``logprobs`` / ``prompt_logprobs`` than ``EngineConfig.max_logprobs``).

``truncate_prompt_tokens`` keeps the last k prompt tokens (``-1``: ``max_model_len``).
``bad_words`` are tokenized as vLLM does: each word as written (leading spaces stripped), and
again with one leading space when that gives a different first token and as many tokens, so a
word is banned at the start of the text and after a space.
"""

from __future__ import annotations

import operator

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.text.tokenizer import Tokenizer
from tokenbudget.scheduler.request import Request

PromptInput = str | list[int] | dict


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
    """``str`` -> encoded; token ids -> checked; ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``
    (with both, as ``Tokenizer.chat_prompt`` makes: the ids, and the text kept for the output)."""
    if isinstance(prompt, dict):
        if prompt.get("prompt_token_ids") is not None:
            text = prompt.get("prompt")
            return text if isinstance(text, str) else None, _token_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" in prompt:
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


def check_params_for_model(params: SamplingParams, vocab_size: int, max_logprobs: int = -1) -> None:
    """The checks of ``params`` that need the model (its vocabulary) or the engine's cap on
    logprobs (``-1``: none; a request's ``-1`` means the whole vocabulary)."""
    for name in ("stop_token_ids", "allowed_token_ids"):
        for t in getattr(params, name) or ():
            if t >= vocab_size:
                raise ValueError(f"{name}: {t} is out of the vocabulary [0, {vocab_size})")
    for t in params.logit_bias or ():
        if t >= vocab_size:
            raise ValueError(f"logit_bias: token id {t} is out of the vocabulary [0, {vocab_size})")
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and (vocab_size if k == -1 else k) > cap:
            raise ValueError(f"{name}: {k} requested, more than the engine's max_logprobs={max_logprobs}")


def bad_words_token_ids(words: list[str] | None, tokenizer: Tokenizer | None,
                        vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """``SamplingParams.bad_words`` as token id sequences (see the module docstring)."""
    if not words:
        return ()
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer")
    result: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (plain, spaced) if spaced[:1] != plain[:1] and len(spaced) == len(plain) else (plain,):
            if any(t >= vocab_size for t in ids):
                raise ValueError(f"bad_words: {word!r} has token ids out of the vocabulary [0, {vocab_size})")
            result.append(ids)
    return tuple(result)


def make_request(request_id: str, prompt: PromptInput, params: SamplingParams, priority: int,
                 tokenizer: Tokenizer | None, vocab_size: int, *, max_model_len: int | None = None,
                 max_logprobs: int = -1) -> tuple[str | None, Request]:
    """A ``Request`` for the scheduler (its ``seed`` is ``params.seed``, else 0 until the engine
    assigns one when it accepts the request)."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int, got {priority!r}")
    text, ids = tokenize_prompt(prompt, tokenizer, vocab_size)
    check_params_for_model(params, vocab_size, max_logprobs)
    keep = params.truncate_prompt_tokens
    if keep is not None:
        if max_model_len is not None and keep > max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({max_model_len})")
        ids = ids[-(max_model_len or len(ids)):] if keep == -1 else ids[-keep:]
    stop_ids = set(params.stop_token_ids)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if not params.ignore_eos and tokenizer is not None:
        stop_ids.update(t for t in tokenizer.eos_token_ids if t != eos)
    request = Request(request_id, ids, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                      eos_token_id=eos, stop_token_ids=frozenset(stop_ids), ignore_eos=params.ignore_eos,
                      priority=priority, sampling_params=params,
                      seed=params.seed if params.seed is not None else 0,
                      max_spec_tokens=params.num_speculative_tokens,
                      bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer, vocab_size),
                      skip_reading_prefix_cache=params.prompt_logprobs is not None)
    return text, request
