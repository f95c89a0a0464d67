"""Per-request, per-position draft acceptance estimates (Beta posteriors, updated online).

Model: a_{r,j} = P(draft j of request r is accepted | drafts 0..j-1 were accepted). One verify
of ``n`` drafts with ``a`` accepted is a Bernoulli trial at positions j < min(n, a + 1) and a
success at positions j < a (acceptance is a prefix, so positions past the first rejection were
never tested and carry no evidence).

Estimates (posterior means):

* engine-wide, per position: p_0 = (prior_alpha + S_0) / (prior_alpha + prior_beta + N_0) and
  p_j = (n0 * p_{j-1} + S_j) / (n0 + N_j) for j > 0, where S_j / N_j are successes / trials
  over all requests and n0 = prior_alpha + prior_beta. ``prior_alpha`` / ``prior_beta`` is the
  configured Beta prior of the method (pseudo-counts); deeper positions take the previous
  position's estimate as their prior mean, so a position nobody has reached yet is assumed to
  behave like the deepest measured one. (A fixed prior there would never be explored: if the
  prior is pessimistic the optimiser never drafts that deep, so it never learns otherwise.)
* per request: a_{r,j} = (s * p_j + s_{r,j}) / (s + n_{r,j}), i.e. a Beta prior centred on the
  engine-wide figure with strength s = ``prior_strength`` pseudo-trials. A new request therefore
  starts at the engine-wide mean and moves toward its own measured rate as evidence arrives.

Staleness (why estimates recover after a request stops drafting):

* Per-request evidence is discounted by ``decay`` at every verify of that request (all positions
  at once), so the effective window is ~1 / (1 - decay) verifies and a position that has not been
  tested recently drifts back toward the engine-wide mean instead of keeping an old verdict.
  The price is a bias toward the engine-wide mean of at most s / (s + 1 / (1 - decay)).
* Engine-wide evidence is discounted by ``global_decay`` once per engine step
  (``decay_global``), so when nobody drafts for a while the engine-wide figure reverts to the
  configured prior — which lets the controller start probing again (see ``spec.adaptive``).

Storage is plain Python lists (one ``Evidence`` per live request, ``max_k`` floats each): the
controller reads and writes a handful of numbers per request per step, right after a forward has
evicted numpy's code from the caches, where one numpy call costs more than the whole update in
lists (figures: benches/RESULTS.md, "Controller overhead").
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Evidence:
    """One request's decayed successes and trials per position, the engine step of its last
    verify that had drafts, and how many probe intervals it waits before the next probe
    (``spec.adaptive``'s probing reads and writes both)."""

    succ: list[float]
    trials: list[float]
    last_drafted_step: int
    probe_backoff: int = 1


class AcceptanceEstimator:
    def __init__(self, max_k: int, *, prior_alpha: float = 1.0, prior_beta: float = 1.0,
                 prior_strength: float = 2.0, decay: float = 0.95,
                 global_decay: float = 0.99) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if prior_alpha <= 0 or prior_beta <= 0:
            raise ValueError(f"prior_alpha and prior_beta must be > 0, got {prior_alpha}, "
                             f"{prior_beta}")
        if prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        for name, v in (("decay", decay), ("global_decay", global_decay)):
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        self.max_k = int(max_k)
        self.prior_alpha = float(prior_alpha)
        self.prior_beta = float(prior_beta)
        self.prior_strength = float(prior_strength)
        self.decay = float(decay)
        self.global_decay = float(global_decay)
        self._rows: dict[str, Evidence] = {}
        # Engine-wide evidence: rebound on every change, never changed in place (snapshots hold
        # references), except by the tests that write through the getters.
        self._global_succ = [0.0] * self.max_k
        self._global_trials = [0.0] * self.max_k
        self._pending_decays = 0  # decay_global calls not yet applied (applied on the next read)

    # ---- requests ----
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def row(self, request_id: str, step: int = 0) -> Evidence:
        """The evidence of ``request_id``, created empty (at the engine-wide prior) on first use."""
        e = self._rows.get(request_id)
        if e is None:
            e = self._rows[request_id] = Evidence([0.0] * self.max_k, [0.0] * self.max_k, step)
        return e

    def rows(self, request_ids: Sequence[str], step: int = 0) -> list[Evidence]:
        get = self._rows.get
        return [get(r) or self.row(r, step) for r in request_ids]

    def snapshot(self) -> tuple:
        """What a step's ``decay_global`` and ``rows`` change (for ``restore`` if it fails); the
        rows themselves change only in ``observe``, after a step has committed."""
        return self._global_succ, self._global_trials, self._pending_decays, dict(self._rows)

    def restore(self, saved: tuple) -> None:
        """Back to ``saved``: rows a failed step created are dropped."""
        self._global_succ, self._global_trials, self._pending_decays, self._rows = saved

    def forget(self, request_id: str) -> None:
        """Drop a finished/aborted request's evidence (its engine-wide share stays)."""
        self._rows.pop(request_id, None)

    # ---- estimates ----
    def global_probs(self) -> list[float]:
        """Engine-wide p_j per position (``max_k`` floats); see the module docstring."""
        n0 = self.prior_alpha + self.prior_beta
        out = []
        prev = self.prior_alpha / n0
        for sj, nj in zip(self.global_succ, self.global_trials):
            prev = (n0 * prev + sj) / (n0 + nj)
            out.append(prev)
        return out

    def first_position_upper(self) -> float:
        """Engine-wide p_0 plus one posterior standard deviation (Beta): an optimistic value
        for a probe. With little evidence (start-up, or evidence decayed while nobody drafted)
        it is well above the mean, so a probe is tried where drafts might pay; as probes add
        evidence it shrinks to the mean, so probing stops where they do not."""
        a = self.prior_alpha + self.global_succ[0]
        b = self.prior_beta + self.global_trials[0] - self.global_succ[0]
        n = a + b
        return min(1.0, a / n + math.sqrt(a * b / (n * n * (n + 1.0))))

    def probs(self, rows: Sequence[Evidence]) -> list[list[float]]:
        """a_{r,j} for the given rows (``max_k`` floats each, in (0, 1))."""
        s = self.prior_strength
        prior = [s * p for p in self.global_probs()]
        return [[(ps + sj) / (s + nj) for ps, sj, nj in zip(prior, e.succ, e.trials)] for e in rows]

    def estimate(self, request_id: str) -> list[float]:
        """a_{r,j} of one request (the engine-wide prior if it has no evidence)."""
        e = self._rows.get(request_id)
        return self.global_probs() if e is None else self.probs([e])[0]

    # ---- evidence ----
    def observe(self, request_id: str, num_draft: int, num_accepted: int, step: int = 0) -> None:
        """One verify of ``request_id``: ``num_draft`` drafts, the first ``num_accepted`` kept.

        ``num_draft == 0`` (a plain decode step) carries no acceptance evidence.
        """
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"need 0 <= num_accepted <= num_draft, got {num_accepted}, "
                             f"{num_draft}")
        if num_draft == 0:
            return
        e = self.row(request_id, step)
        e.last_drafted_step = step
        tested = min(num_draft, num_accepted + 1, self.max_k)
        won = min(num_accepted, self.max_k)
        d = self.decay
        e.succ = [x * d + (j < won) for j, x in enumerate(e.succ)]
        e.trials = [x * d + (j < tested) for j, x in enumerate(e.trials)]
        self._global_succ = [x + (j < won) for j, x in enumerate(self.global_succ)]
        self._global_trials = [x + (j < tested) for j, x in enumerate(self.global_trials)]

    def decay_global(self) -> None:
        """Discount engine-wide evidence once per engine step (reverts to the prior when idle).
        Counted here and applied as one factor on the next read: a step where nobody drafts (most
        steps of open chat) then costs nothing here."""
        self._pending_decays += 1

    def _apply_decays(self) -> None:
        if self._pending_decays and self.global_decay < 1.0:
            f = self.global_decay ** self._pending_decays
            self._global_succ = [x * f for x in self._global_succ]
            self._global_trials = [x * f for x in self._global_trials]
        self._pending_decays = 0

    @property
    def global_succ(self) -> list[float]:
        """Engine-wide successes per position (decayed; the list itself, writable)."""
        self._apply_decays()
        return self._global_succ

    @property
    def global_trials(self) -> list[float]:
        """Engine-wide trials per position (decayed; the list itself, writable)."""
        self._apply_decays()
        return self._global_trials
