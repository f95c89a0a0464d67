"""``StructuredOutputsParams``: what a request's output must match (vLLM's current API names).

Exactly one of ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice`` (a
non-empty list of strings: the output is one of them), ``grammar`` (a Lark grammar, or the
GBNF/EBNF that llama.cpp and xgrammar read) or ``json_object=True`` (any JSON object) is set.

Checked at construction, without a tokenizer: a bad value is a ``ValueError`` whose message
starts with ``structured_outputs.<field>``, so ``SamplingParams(structured_outputs=...)`` fails
before any request exists (the vocabulary-dependent part is checked at ``add_request``).

Decision, where vLLM users might expect otherwise: JSON is generated in ``json.dumps``' default
layout (``", "`` between items, ``": "`` after keys, no other whitespace). vLLM allows any
whitespace by default; a small model then can emit newlines forever, and one layout makes the
output deterministic to read and cheaper to generate.
"""

from __future__ import annotations

import json as _json
from typing import Any

import msgspec
from msgspec.structs import force_setattr

__all__ = ["StructuredOutputsParams"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, frozen=True, kw_only=True):
    """One constraint on a request's output; see the module docstring."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            force_setattr(self, "choice", list(self.choice))
        kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(kinds) or 'none'}")
        self._check_types(kinds[0])
        from tokenbudget.api.grammar_source import grammar_source  # llguidance: imported on first use
        grammar_source(self)  # ValueError naming the field for an invalid schema/regex/grammar

    def _check_types(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
        if kind == "json" and not isinstance(value, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {value!r}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        if kind == "choice" and (not isinstance(value, list) or not value
                                 or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r}")
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be True or None, got {value!r}")

    @property
    def kind(self) -> str:
        """The field that is set: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))
