"""The grammar source of a ``StructuredOutputsParams``, built and checked without a tokenizer.

It sits with the options (the bottom layer) because ``SamplingParams(structured_outputs=...)``
rejects an invalid schema, regex or grammar at construction (a ``ValueError`` naming the field),
before any engine or vocabulary exists; the engine's grammar backend
(``engine/structured/llguidance_backend.py``) builds its matchers from this same source.

Sources are cached by the bytes they hold (``byte_cache``), never by count: one schema can be
megabytes. Grammars are checked, and matchers built, under ``PARSER_LIMITS``: llguidance's
defaults without its verbose state dumps in errors (they are returned to clients and logged, and
must not quote a grammar back).
"""

from __future__ import annotations

import json

import llguidance

from tokenbudget.api.byte_cache import ByteBoundedCache

SOURCE_CACHE_BYTES = 32 << 20  # compiled grammar sources kept (keys + values)
PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_SOURCES = ByteBoundedCache(SOURCE_CACHE_BYTES)

# json.dumps' default layout (see ``structured_params``).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_source(params) -> str:
    """The grammar for ``params`` (cached); ValueError naming the field when invalid."""
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
    error = M.validate_grammar(source, limits=PARSER_LIMITS)
    if error:
        raise ValueError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {error.strip()}")
    return source


_WHAT = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}
