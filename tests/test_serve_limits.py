"""The server's limit checks as functions (``engine/serve/limits.py``) and the byte-bounded
grammar cache: properties the HTTP tests rely on, checked over many inputs (Hypothesis)."""

from __future__ import annotations

import functools
import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget import StructuredOutputsParams
from tokenbudget.api import grammar_source
from tokenbudget.engine.serve.json_depth import max_depth
from tokenbudget.engine.serve.limits import prompt_byte_bound

from model_helpers import smollm2_gguf_tokenizer  # noqa: E402

BRACKETY = st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=8)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | BRACKETY,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(BRACKETY, inner, max_size=3),
                    max_leaves=30)


def depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


@given(JSON)
def test_json_depth_counts_structure_never_brackets_inside_strings(value):
    assert max_depth(msgspec.json.encode(value)) == depth(value)
    assert max_depth(json.dumps(value, indent=1).encode()) == depth(value)


@functools.cache
def default_tokenizer_and_bound():
    tokenizer = smollm2_gguf_tokenizer()
    return tokenizer, prompt_byte_bound(tokenizer)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_a_text_never_needs_fewer_tokens_than_its_bytes_allow(text):
    """The rule that refuses a prompt before tokenizing: tokens >= min_tokens(bytes), control
    bytes the vocabulary lacks (and drops) included."""
    tokenizer, bound = default_tokenizer_and_bound()
    assert bound is not None  # byte-level BPE: the bound is certain
    assert len(tokenizer.encode(text)) >= bound.min_tokens(text.encode("utf-8", "surrogatepass"))


def test_text_of_dropped_bytes_is_not_refused_by_its_length():
    tokenizer, bound = default_tokenizer_and_bound()
    assert tokenizer.encode("\x16") == [] and bound.min_tokens(b"\x16" * 10**6) == 0


def test_grammar_source_cache_is_bounded_by_bytes():
    """Twenty schemas with a 5 MB description each once stayed in the cache (~350 MB)."""
    cache = grammar_source._SOURCES
    for i in range(20):
        StructuredOutputsParams(json={"type": "string", "description": f"{i}" + "d" * (5 << 20)})
        assert cache.num_bytes <= cache.max_bytes == grammar_source.SOURCE_CACHE_BYTES
    StructuredOutputsParams(json={"type": "integer"})
    assert 0 < len(cache) and cache.num_bytes <= cache.max_bytes
