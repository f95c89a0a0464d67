"""OpenAI response objects (plain dicts, encoded with msgspec) from engine outputs.

Shapes follow what the official ``openai`` client parses: ``text_completion`` /
``chat.completion`` objects, their streamed chunks, ``usage`` with
``prompt_tokens_details.cached_tokens``, and logprobs with token strings (completions:
``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``; chat: ``content`` entries with
``token``/``logprob``/``bytes``/``top_logprobs``). A token's string is its ``Logprob.decoded_token``
(vLLM's: a part of a multi-byte character is "" until the token that completes it,
``engine.text.token_strings``), so the strings join to the text and their ``bytes`` to its bytes.
"""

from __future__ import annotations

from tokenbudget.api.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

MAX_ERROR_CHARS = 400  # an error quotes at most this much of anything (input included)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict:
    """OpenAI's error object; the message cut short and no ``param`` longer than a field name,
    so no error body is ever large (a 10 MB ``model`` name is not sent back)."""
    return {"error": {"message": _clip(str(message), MAX_ERROR_CHARS), "type": kind,
                      "param": param if param is None or len(str(param)) <= 64 else None, "code": code}}


# How a request that ended with ``finish_reason="error"`` is answered: a fault of what the request
# asked for (its grammar: masks past their budget, a token it refuses; parameters that leave no
# token allowed) is the client's, a 400 (a router must not retry it elsewhere: it fails there too);
# anything else the engine isolated to the request stays a 500. The reason's first word says which
# (``scheduler.request_fault``: a request fault names its field).
_REQUEST_FAULTS = {"structured_outputs": "response_format", "no token is allowed": None}


def request_error_status(reason: str | None) -> tuple[int, str | None]:
    """``(HTTP status, error.param)`` for a request that failed in a step with ``reason``."""
    for prefix, param in _REQUEST_FAULTS.items():
        if (reason or "").startswith(prefix):
            return 400, param
    return 500, None


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def usage(prompt_tokens: int, completion_tokens: int, metrics: RequestMetrics | None) -> dict:
    cached = metrics.num_cached_tokens if metrics is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


class TokenText:
    """Token id -> its text, cached (the same few thousand tokens come back all the time)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False) if self._tokenizer else str(token_id)
            self._cache[token_id] = text
        return text


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda kv: (-kv[1], kv[0]))[:n]


def _string(entry: dict[int, Logprob], token_id: int, text: TokenText) -> str:
    decoded = entry[token_id].decoded_token
    return decoded if decoded is not None else text(token_id)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, n: int, text: TokenText,
                        offset: int = 0) -> dict | None:
    """Completions-API logprobs; ``offset`` is the text offset of the first token."""
    if logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        s = _string(entry, tid, text)
        tokens.append(s)
        token_lps.append(entry[tid].logprob)
        tops.append({_string(entry, t, text): lp for t, lp in _top(entry, n)} if n else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, n: int,
                  text: TokenText) -> dict | None:
    if logprobs is None:
        return None

    def item(entry: dict[int, Logprob], tid: int, lp: float) -> dict:
        s = _string(entry, tid, text)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}

    return {"content": [dict(item(entry, tid, entry[tid].logprob),
                             top_logprobs=[item(entry, t, lp) for t, lp in _top(entry, n)])
                        for tid, entry in zip(token_ids, logprobs)]}


def completion_object(rid: str, created: int, model: str, out: RequestOutput, n_logprobs: int,
                      text: TokenText) -> dict:
    """One choice per completion (``n``), in index order; usage counts them all."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": completion_logprobs(c.token_ids, c.logprobs, n_logprobs, text)}
                        for c in out.outputs],
            "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.metrics)}


def chat_object(rid: str, created: int, model: str, out: RequestOutput, n_logprobs: int, text: TokenText,
                tools=None) -> dict:
    """One choice per completion; ``tools`` (a ``tool_calls.ToolRequest``) makes each message
    and finish reason (tool calls), else the message is the text."""
    choices = []
    for c in out.outputs:
        message, finish_reason = (tools.message(c.text, c.finish_reason) if tools is not None
                                  else ({"role": "assistant", "content": c.text}, c.finish_reason))
        choices.append({"index": c.index, "message": message, "finish_reason": finish_reason,
                        "logprobs": chat_logprobs(c.token_ids, c.logprobs, n_logprobs, text)})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.metrics)}


def completion_chunk(rid: str, created: int, model: str, c: CompletionOutput, n_logprobs: int, text: TokenText,
                     offset: int) -> dict:
    """One choice's piece (``c.index``); ``offset``: that choice's text offset so far."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": completion_logprobs(c.token_ids, c.logprobs, n_logprobs, text, offset)}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, prompt_tokens: int, completion_tokens: int,
                metrics: RequestMetrics | None) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, metrics)}
