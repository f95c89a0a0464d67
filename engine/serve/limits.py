"""What one request may ask of the server: the limits, their defaults, and the checks.

Threat model: anyone who can reach the port (docs/serving.md, "Security and limits"). Every
limit here is a ``tokenbudget serve`` flag; a request past one is answered before it costs
anything more than reading its body: 413 for the body, 400 naming the field and the flag for the
rest. Each check is linear in the bytes received and needs no recursion, so no input can make a
check itself the problem (a JSON value nested 100k deep is measured, not decoded).
"""

from __future__ import annotations

import json
from typing import NamedTuple

import msgspec

from tokenbudget.engine.serve.json_depth import deep_field, max_depth
from tokenbudget.scheduler.request_fault import short


class ServerLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The server's limits (defaults in the field list; the flag is ``--`` + the name, dashed).
    Seconds are floats, everything else a positive integer."""

    max_request_bytes: int = 4 << 20  # request body; past it: 413
    max_prompt_tokens: int | None = None  # None: the engine's max_model_len
    max_json_depth: int = 64  # nesting of any value in a body (message content parts, ...)
    max_schema_bytes: int = 64 << 10  # response_format, as sent
    max_schema_depth: int = 32  # nesting inside response_format (its JSON schema included)
    max_n: int = 16
    max_stop_strings: int = 16  # entries of stop
    max_stop_string_chars: int = 256  # length of one stop string
    max_stop_token_ids: int = 256  # entries of stop_token_ids
    max_logit_bias: int = 300  # entries of logit_bias (OpenAI's bound)
    # Preparation (decode, template, tokenize, compile; engine/serve/preparation.py): past either, 429
    max_preparing_requests: int = 256  # requests waiting for or in preparation, all clients together
    max_preparing_per_client: int = 64  # of them from one client address
    # The HTTP layer (engine/serve/connections.py); uvicorn's names where it has one
    timeout_headers: float = 10.0  # seconds from connect (or the previous response) to complete headers; 408
    timeout_body: float = 30.0  # seconds from complete headers to the whole body; 408
    timeout_keep_alive: float = 5.0  # uvicorn's: an idle kept-alive connection closes after this
    h11_max_incomplete_event_size: int = 16 << 10  # uvicorn's: bytes of an unfinished header block; 400
    max_connections: int = 1024  # open connections (at most the descriptor limit less 64); past it the
    #                              oldest one still sending its headers is closed (408)

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is None and name == "max_prompt_tokens":
                continue
            if isinstance(self.__struct_defaults__[self.__struct_fields__.index(name)], float):
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def flag(name: str) -> str:
    """The command-line flag of a limit (``max_n`` -> ``--max-n``)."""
    return "--" + name.replace("_", "-")


class LimitError(ValueError):
    """A request past a limit; ``param`` is the field (OpenAI's ``error.param``), ``status`` the
    HTTP status (400, or 413 for the body)."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def check_depth(body: bytes, limits: ServerLimits) -> None:
    """The nesting depth of each top-level field of a body, measured on the raw JSON before
    anything decodes it (``json_depth``: linear time; decoders recurse, so a value nested 100k
    deep must never reach one): ``response_format`` against ``max_schema_depth``, every other
    field against ``max_json_depth``."""
    floor = min(limits.max_json_depth, limits.max_schema_depth)
    if body.count(b"[") + body.count(b"{") <= floor + 1 or max_depth(body) - 1 <= floor:
        return  # (too few brackets to nest deeper, whatever the strings hold: the usual body)

    def limit_of(name: str | None) -> int:
        return limits.max_schema_depth if name == "response_format" else limits.max_json_depth

    deep = deep_field(body, limit_of, floor, max(limits.max_json_depth, limits.max_schema_depth) + 1)
    if deep is None:
        return
    which = "max_schema_depth" if deep.name == "response_format" else "max_json_depth"
    if deep.name is None:
        raise LimitError(f"the request body is nested more than {flag(which)}={limit_of(None)} levels deep", None)
    raise LimitError(f"{short(deep.name, 64)} is nested more than {flag(which)}={limit_of(deep.name)} levels deep",
                     deep.name)


def check_counts(req, limits: ServerLimits) -> None:
    """``n``, ``stop``, ``stop_token_ids``, ``logit_bias`` and the schema's size, of a decoded body."""
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        size = len(msgspec.json.encode(response_format))
        if size > limits.max_schema_bytes:
            raise LimitError(f"response_format is {size} bytes, more than {flag('max_schema_bytes')}="
                             f"{limits.max_schema_bytes}", "response_format")
    if req.n is not None and req.n > limits.max_n:
        raise LimitError(f"n={req.n} is more than {flag('max_n')}={limits.max_n}", "n")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if req.stop_token_ids and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise LimitError(f"stop_token_ids has {len(req.stop_token_ids)} entries, more than "
                         f"{flag('max_stop_token_ids')}={limits.max_stop_token_ids}", "stop_token_ids")
    if len(stop) > limits.max_stop_strings:
        raise LimitError(f"stop has {len(stop)} strings, more than {flag('max_stop_strings')}="
                         f"{limits.max_stop_strings}", "stop")
    if any(len(s) > limits.max_stop_string_chars for s in stop):
        raise LimitError(f"a stop string is longer than {flag('max_stop_string_chars')}="
                         f"{limits.max_stop_string_chars} characters", "stop")
    if req.logit_bias and len(req.logit_bias) > limits.max_logit_bias:
        raise LimitError(f"logit_bias has {len(req.logit_bias)} entries, more than {flag('max_logit_bias')}="
                         f"{limits.max_logit_bias}", "logit_bias")


class ByteBound(NamedTuple):
    """A certain lower bound on a text's token count from its bytes alone (``prompt_byte_bound``)."""

    bytes_per_token: int  # the most UTF-8 bytes of text one token stands for
    dropped: bytes  # byte values the tokenizer has no symbol for: it drops them, so they count for nothing

    def min_tokens(self, data: bytes) -> int:
        counted = len(data.translate(None, self.dropped)) if self.dropped else len(data)  # one pass
        return -(-counted // self.bytes_per_token)


def prompt_byte_bound(tokenizer) -> ByteBound | None:
    """The bound, when it is certain for this tokenizer; None otherwise.

    The rule behind refusing a prompt before tokenizing: if the tokenization loses no text except
    bytes it has no symbol for, and every token decodes to at most L bytes, then a text of B
    counted bytes needs at least B / L tokens. That holds for byte-level BPE without a normalizer
    (each byte has a symbol in the alphabet, or is dropped when the vocabulary lacks it: the
    default model's lacks a few control bytes) and for byte-fallback models with all 256 byte
    tokens and a normalizer that never deletes text. For any other tokenizer (an ``<unk>`` can
    stand for a whole run of characters) there is no such bound: the prompt is tokenized (off the
    event loop) and counted. Decoding a token alone over-counts partial UTF-8 (a lone byte decodes
    to 3), which only makes L larger: the bound stays safe.
    """
    backend = tokenizer.backend
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else None
    if vocab is None or not _only_adds(spec.get("normalizer")):
        return None
    if _has(spec.get("pre_tokenizer"), "ByteLevel") and spec.get("normalizer") is None:
        symbols = _byte_level_symbols()
        dropped = bytes(b for b in range(256) if symbols[b] not in vocab)
    elif model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        dropped = b""
    else:
        return None
    texts = backend.decode_batch([[i] for i in range(backend.get_vocab_size(with_added_tokens=True))],
                                 skip_special_tokens=False)
    return ByteBound(max(4, max(len(t.encode("utf-8")) for t in texts)), dropped)


def _byte_level_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the symbol of each byte value (printable bytes as themselves,
    the others shifted past 255 in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    symbols, shift = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shift)
            shift += 1
    return [symbols[b] for b in range(256)]


def _has(component, kind: str) -> bool:
    if not component:
        return False
    if component.get("type") == kind:
        return True
    return any(_has(c, kind) for c in component.get("pretokenizers") or component.get("normalizers") or [])


def _only_adds(normalizer) -> bool:
    """A normalizer that never deletes text: none, Prepend, or Replace with a non-empty content."""
    if not normalizer:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_only_adds(n) for n in normalizer.get("normalizers") or [])
    if kind == "Prepend":
        return True
    return kind == "Replace" and bool(normalizer.get("content"))
