"""The llguidance implementation of ``backend.GrammarBackend`` (why llguidance: ``backend``).

llguidance matchers never raise on user errors: a bad grammar or an illegal token puts the
matcher into an error state it never leaves. So tokens are checked with ``validate_tokens``
(which changes nothing) before they are consumed, and a grammar is checked when its source is
built (``LLMatcher.validate_grammar``, tokenizer-free: ``tokenbudget/api/grammar_source.py``) and again
when a matcher is built on the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np

from tokenbudget.api.grammar_source import PARSER_LIMITS
from tokenbudget.engine.structured.backend import GrammarBackend, GrammarMatcher


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("_m", "cost")

    def __init__(self, matcher: llguidance.LLMatcher, cost: float = 0.0) -> None:
        self._m = matcher
        self.cost = cost

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
        return LLGuidanceMatcher(self._m.deep_copy(), self.cost)


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
        m = llguidance.LLMatcher(self._tokenizer, source, log_level=0, limits=PARSER_LIMITS)
        if m.is_error():
            raise ValueError(f"structured_outputs: the grammar cannot be used with this model: {m.get_error()}")
        return LLGuidanceMatcher(m)


def load_backend(tokenizer, vocab_size: int) -> GrammarBackend:
    """The backend for ``tokenizer`` (an ``engine.text.Tokenizer``) and ``vocab_size`` logits."""
    return LLGuidanceBackend(tokenizer, vocab_size)
