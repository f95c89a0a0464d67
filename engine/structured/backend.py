"""The grammar library behind one small interface, and the choice of library.

Choice: **llguidance** (``benches/structured_backends.py``, results in ``benches/RESULTS.md``).
On this CPU and the default model's 49k-token vocabulary, against xgrammar 0.2.8:

* compiling a schema and computing its first mask: ~0.8 ms median (llguidance builds lazily)
  against ~10 ms (xgrammar precomputes per-state token caches), up to 7 ms against 140 ms;
* mask per token: median ~17 us against ~3 us (xgrammar caches masks per state), but mean ~60 us
  against ~210 us and p99 ~0.6 ms against ~6 ms: a verify row whose state is new pays xgrammar's
  tail, and speculation makes new states common;
* set-up on the vocabulary: ~0.3 s against ~1.5 s;
* both roll back exactly (a mask after ``accept k, rollback k`` equals the earlier one);
* llguidance has no Python dependencies (xgrammar pulls transformers, triton, pydantic and a
  TVM runtime), and it validates a grammar without a tokenizer, so ``SamplingParams`` can
  reject a bad schema at construction.

The interface is what the engine needs and no more: a tokenizer-free ``grammar_source`` (the
check at ``SamplingParams``), and per request a ``GrammarMatcher`` that fills a packed bitmask
row, says how many of some tokens it would accept, consumes tokens, rolls back, and says when the
output is complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenbudget.engine.structured.params import StructuredOutputsParams

__all__ = ["GrammarBackend", "GrammarMatcher", "grammar_source", "load_backend"]


class GrammarMatcher(ABC):
    """One request's grammar state: the output tokens consumed so far."""

    @abstractmethod
    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the legal next tokens into ``out`` (int32, one bit per token id, LSB first)."""

    @abstractmethod
    def num_legal(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts in a row; the state is unchanged."""

    @abstractmethod
    def consume(self, tokens: Sequence[int]) -> None:
        """Advance through ``tokens`` (all legal: checked with ``num_legal`` first)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed."""

    @abstractmethod
    def is_complete(self) -> bool:
        """The output matches and nothing may follow but EOS: the request is done."""

    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher can go no further (a grammar it cannot follow, a resource limit), or
        None. A matcher in error is the fault of its request, never of the engine."""

    @abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (the children of an ``n > 1`` request)."""


class GrammarBackend(ABC):
    """Builds matchers for one vocabulary."""

    name: str

    @property
    @abstractmethod
    def bitmask_width(self) -> int:
        """int32 words per bitmask row."""

    @abstractmethod
    def matcher(self, source: str) -> GrammarMatcher:
        """A matcher at the start of ``source`` (from ``grammar_source``); ValueError naming
        ``structured_outputs`` when the grammar cannot be built on this vocabulary."""


def grammar_source(params: StructuredOutputsParams) -> str:
    """The backend's grammar for ``params`` (cached); ValueError naming the field when invalid."""
    from tokenbudget.engine.structured.llguidance_backend import grammar_source as source
    return source(params)


def load_backend(tokenizer, vocab_size: int) -> GrammarBackend:
    """The backend for ``tokenizer`` (an ``engine.text.Tokenizer``) and ``vocab_size`` logits."""
    from tokenbudget.engine.structured.llguidance_backend import LLGuidanceBackend
    return LLGuidanceBackend(tokenizer, vocab_size)
