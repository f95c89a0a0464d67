"""The nesting depth of untrusted JSON, measured in linear time before anything decodes it.

Decoders recurse, so a value nested 100k deep must never reach one; and no scan of the raw bytes
may be worse than linear in them (a regex that looks for the end of a string from every escaped
quote is quadratic: a 64 KB body of ``"\\"\\"\\"...`` once froze the server for 20 s). Here every
pass is a fixed number of numpy operations over 1 MiB chunks, so 4 MiB of any shape costs
about 4 times 1 MiB, and no pass holds a temporary larger than a few times a chunk.

The rule that tells structure from text: inside a string a quote is escaped exactly when an odd
run of backslashes precedes it; a bracket counts when an even number of unescaped quotes
precedes it. On any prefix of a body that is valid JSON this agrees with every JSON decoder
(outside strings a backslash is invalid, and decoding stops there), so a decoder never nests
deeper than the depth measured here, whatever follows the point where the body stops being
JSON.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np

CHUNK = 1 << 20
_BACKSLASH, _QUOTE, _COMMA, _BRACE = 0x5C, 0x22, 0x2C, 0x7B
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


class _Carry(NamedTuple):
    """What one chunk hands the next: the depth, whether a string is open, the backslashes
    that end the chunk."""

    depth: int = 0
    in_string: int = 0
    backslashes: int = 0


class _Chunk(NamedTuple):
    depth: np.ndarray  # int32: the structural depth after each byte
    outside: np.ndarray  # bool: the byte is structure (no string is open before it)
    quotes: np.ndarray  # bool: an unescaped quote
    carry: _Carry


def _scan(chunk: bytes, carry: _Carry) -> _Chunk:
    b = np.frombuffer(chunk, dtype=np.uint8)
    n = len(b)
    is_backslash = b == _BACKSLASH
    index = np.arange(n, dtype=np.int32)
    # last[i]: the latest byte at or before i that is not a backslash (before the chunk: a
    # virtual one, ``backslashes`` bytes back), so i - last[i] backslashes end at i.
    last = np.where(is_backslash, np.int32(-1 - carry.backslashes), index)
    np.maximum.accumulate(last, out=last)
    run_before = np.empty(n, dtype=np.int32)  # backslashes right before each byte
    run_before[0] = carry.backslashes
    run_before[1:] = index[:-1] - last[:-1]
    quotes = (b == _QUOTE) & ((run_before & 1) == 0)
    opened = np.cumsum(quotes, dtype=np.int32)  # unescaped quotes up to and including each byte
    outside = ((opened + carry.in_string) & 1) == 0  # for a bracket (never a quote) the parity before it
    depth = np.cumsum(_STEP[b] * outside, dtype=np.int32)
    depth += carry.depth
    ends = int(n - 1 - last[-1])
    return _Chunk(depth, outside, quotes, _Carry(int(depth[-1]), int(opened[-1] + carry.in_string) & 1, ends))


def max_depth(raw: bytes) -> int:
    """The deepest nesting of one JSON text (``1`` for ``[]``, ``0`` for a number)."""
    carry, deepest = _Carry(), 0
    for start in range(0, len(raw), CHUNK):
        part = _scan(raw[start:start + CHUNK], carry)
        deepest, carry = max(deepest, int(part.depth.max())), part.carry
    return deepest


class DeepField(NamedTuple):
    """A top-level member nested deeper than its limit: its name (None when the body is no
    object or the name cannot be read) and its depth (counted from inside the member, capped)."""

    name: str | None
    depth: int


def deep_field(raw: bytes, limit_of, floor: int, cap: int) -> DeepField | None:
    """The first top-level member of ``raw`` nested deeper than ``limit_of(name)`` (``name``
    None where the body is no JSON object), or None; ``floor`` is the smallest limit. Linear in
    ``raw``: every pass is over the whole body once, and each member is looked at once, only
    where it nests deeper than ``floor``."""
    depth, outside, quotes = _whole(raw)
    b = np.frombuffer(raw, dtype=np.uint8)
    if raw.lstrip()[:1] == b"{":  # member separators of the top-level object: its brace and commas
        separators = np.flatnonzero(outside & (depth == 1) & ((b == _COMMA) | (b == _BRACE)))
    else:
        separators = np.zeros(0, dtype=np.int64)
    quote_at = np.flatnonzero(quotes)
    over = np.flatnonzero(depth > floor + 1)  # bytes nested deeper than the smallest limit
    i = 0
    while i < len(over):
        at = int(over[i])
        k = int(np.searchsorted(separators, at, side="right")) - 1
        start = int(separators[k]) if k >= 0 else 0
        end = int(separators[k + 1]) if k + 1 < len(separators) else len(raw)
        name = _key(raw, quote_at, start) if k >= 0 else None
        deepest = int(depth[start:end].max()) - 1
        if deepest > limit_of(name):
            return DeepField(name, min(deepest, cap))
        i = int(np.searchsorted(over, end))
    return None


def _whole(raw: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_scan`` over the whole body (chunk by chunk), concatenated."""
    depth = np.empty(len(raw), dtype=np.int32)
    outside = np.empty(len(raw), dtype=bool)
    quotes = np.empty(len(raw), dtype=bool)
    carry = _Carry()
    for start in range(0, len(raw), CHUNK):
        part = _scan(raw[start:start + CHUNK], carry)
        stop = start + len(part.depth)
        depth[start:stop], outside[start:stop], quotes[start:stop], carry = part
    return depth, outside, quotes


def _key(raw: bytes, quote_at: np.ndarray, separator: int) -> str | None:
    """The name of the member after ``separator``: the string between the next two unescaped
    quotes, decoded as JSON (so escapes spell the name the decoder will see)."""
    i = int(np.searchsorted(quote_at, separator, side="right"))
    if i + 1 >= len(quote_at):
        return None
    try:
        name = msgspec.json.decode(raw[int(quote_at[i]):int(quote_at[i + 1]) + 1])
    except msgspec.DecodeError:
        return None
    return name if isinstance(name, str) else None
