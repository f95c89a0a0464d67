"""Speculative-decoding counters.

One ``observe(num_draft, num_accepted)`` per request per verify step. Steps with no draft
(num_draft == 0) are plain decode steps: they count in the k-histogram (k = 0) but not in
``num_drafts``, so α and τ describe verify steps only, as in vLLM's spec-decode metrics.

* acceptance rate α = num_accepted_tokens / num_draft_tokens
* mean accepted length τ = 1 + num_accepted_tokens / num_drafts: tokens emitted per verify step,
  the bonus/recovered token included.
* acceptance by position: ``accepted_per_pos[i]`` counts verify steps whose draft i was accepted
  (acceptance is a prefix, so it never increases with i); divided by ``drafted_per_pos[i]``
  (steps that drafted at least i + 1 tokens) it is the conditional rate per position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    k_histogram: dict[int, int] = field(default_factory=dict)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Record one request's verify step: ``num_draft`` drafts, first ``num_accepted`` kept."""
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"need 0 <= num_accepted <= num_draft, got {num_accepted}, {num_draft}")
        self.k_histogram[num_draft] = self.k_histogram.get(num_draft, 0) + 1
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        _grow(self.accepted_per_pos, num_draft)
        _grow(self.drafted_per_pos, num_draft)
        for i in range(num_draft):
            self.drafted_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """α; 0.0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ, tokens per verify step including the bonus token; 1.0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def mean_draft_length(self) -> float:
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_by_position(self) -> list[float]:
        """P(draft i accepted | draft i proposed), per position i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def merge(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """Add ``other`` into self (in place) and return self."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.accepted_per_pos, other.accepted_per_pos),
                             (self.drafted_per_pos, other.drafted_per_pos)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v
        for k, v in other.k_histogram.items():
            self.k_histogram[k] = self.k_histogram.get(k, 0) + v
        return self

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos.clear()
        self.drafted_per_pos.clear()
        self.k_histogram.clear()

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "mean_draft_length": self.mean_draft_length,
            "accepted_per_pos": list(self.accepted_per_pos),
            "drafted_per_pos": list(self.drafted_per_pos),
            "acceptance_by_position": self.acceptance_by_position(),
            "k_histogram": {int(k): v for k, v in sorted(self.k_histogram.items())},
        }

    def summary(self) -> str:
        """One line for the CLI."""
        by_pos = ",".join(f"{r:.2f}" for r in self.acceptance_by_position())
        hist = " ".join(f"{k}:{v}" for k, v in sorted(self.k_histogram.items()))
        return (f"spec: drafts={self.num_drafts} draft_tokens={self.num_draft_tokens} "
                f"accepted={self.num_accepted_tokens} alpha={self.acceptance_rate:.3f} "
                f"tau={self.mean_accepted_length:.2f} by_pos=[{by_pos}] k_hist={{{hist}}}")


def _grow(lst: list[int], n: int) -> None:
    if len(lst) < n:
        lst.extend([0] * (n - len(lst)))
