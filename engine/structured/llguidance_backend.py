"""The llguidance implementation of ``backend.GrammarBackend`` (why llguidance: ``backend``).

llguidance matchers never raise on user errors: a bad grammar or an illegal token puts the
matcher into an error state it never leaves. So tokens are checked with ``validate_tokens``
(which changes nothing) before they are consumed, and a grammar is checked when its source is
built (``LLMatcher.validate_grammar``, tokenizer-free) and again when a matcher is built on the
vocabulary.

Compiled grammar sources are cached by the bytes they hold (``byte_cache``), never by count.
Errors are built without llguidance's verbose state dumps (``verbose_errors=False``): they are
returned to clients and logged, and must not quote a grammar back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import numpy as np

from tokenbudget.engine.structured.backend import GrammarBackend, GrammarMatcher
from tokenbudget.engine.structured.byte_cache import ByteBoundedCache

SOURCE_CACHE_BYTES = 32 << 20  # compiled grammar sources kept (keys + values)
_SOURCES = ByteBoundedCache(SOURCE_CACHE_BYTES)
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

# json.dumps' default layout (see ``params``).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_source(params) -> str:
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json":
        value = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        value = json.dumps(value)
    return _SOURCES.get_or_build((kind, value), len(str(value)), lambda: _source(kind, value))


def _source(kind: str, text: str) -> str:
    M = llguidance.LLMatcher
    try:
        if kind == "json":
            source = M.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)
        elif kind == "json_object":
            source = M.grammar_from_json_schema('{"type": "object"}', overrides=_JSON_OPTIONS)
        elif kind == "regex":
            source = M.grammar_from_regex(text)
        elif kind == "choice":
            source = llguidance.grammar_from("choice", text)
        else:
            source = llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise ValueError(f"structured_outputs.{kind}: {exc}") from None
    error = M.validate_grammar(source, limits=_LIMITS)
    if error:
        raise ValueError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {error.strip()}")
    return source


_WHAT = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fill_bitmask(self, out: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def num_legal(self, tokens: Sequence[int]) -> int:
        return self._m.validate_tokens(list(tokens)) if tokens else 0

    def consume(self, tokens: Sequence[int]) -> None:
        if tokens and not self._m.consume_tokens(list(tokens)):
            raise RuntimeError(f"grammar refused tokens it had validated: {self.error()}")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_complete(self) -> bool:
        return self._m.is_stopped()

    def error(self) -> str | None:
        return self._m.get_error().replace("<non-verbose/>", "").strip() if self._m.is_error() else None

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        self._tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab,
                                                 eos_token=list(tokenizer.eos_token_ids) or None)
        self._width = (n_vocab + 31) // 32

    @property
    def bitmask_width(self) -> int:
        return self._width

    def matcher(self, source: str) -> LLGuidanceMatcher:
        m = llguidance.LLMatcher(self._tokenizer, source, log_level=0, limits=_LIMITS)
        if m.is_error():
            raise ValueError(f"structured_outputs: the grammar cannot be used with this model: {m.get_error()}")
        return LLGuidanceMatcher(m)
