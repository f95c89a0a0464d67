"""The grammar library behind one small interface, and the choice of library.

Choice: **llguidance** (``benches/structured_backends.py``; figures in ``benches/RESULTS.md``).
On this CPU and the default model's 49k-token vocabulary, against xgrammar 0.2.8:

* compiling a schema and computing its first mask is an order of magnitude faster (llguidance
  builds lazily; xgrammar precomputes per-state token caches);
* a mask per token is slower at the median (xgrammar caches masks per state) but faster in mean
  and tail: a verify row whose state is new pays xgrammar's tail, and speculation makes new
  states common;
* set-up on the vocabulary is several times faster;
* both roll back exactly (a mask after ``accept k, rollback k`` equals the earlier one);
* llguidance has no Python dependencies (xgrammar pulls transformers, triton, pydantic and a
  TVM runtime), and it validates a grammar without a tokenizer, so ``SamplingParams`` can
  reject a bad schema at construction.

The interface is what the engine needs and no more: per request a ``GrammarMatcher`` (built from
the tokenizer-free grammar source, ``tokenbudget/api/grammar_source.py``, which is also the check at
``SamplingParams``) that fills a packed bitmask row, says how many of some tokens it would
accept, consumes tokens, rolls back, and says when the output is complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    pass

__all__ = ["GrammarBackend", "GrammarMatcher"]


class GrammarMatcher(ABC):
    """One request's grammar state: the output tokens consumed so far. ``cost``: the CPU seconds
    its next masks are expected to take (kept by the manager; the step's mask budget reads it)."""

    cost: float = 0.0

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
