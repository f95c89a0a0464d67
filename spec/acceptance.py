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

Where it lives (``tokenbudget.request_table``): per-request evidence in a ``RequestTable``
(request id -> {kind: Evidence}), engine-wide evidence in an ``EngineRecord`` (kind ->
``GlobalEvidence``); every record and every list in one is replaced, never changed in place, so
the step journal undoes what a failed step wrote (rows created while choosing, decays applied).
The draft-length controller shares one pair among the estimators of all its draft kinds; an
estimator made alone keeps a pair of its own. The engine-wide decay counts engine steps: the
estimator's ``clock`` (the controller's step), or ``decay_global`` calls when it has none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

from tokenbudget.request_table import EngineRecord, RequestTable


@dataclass(slots=True)
class Evidence:
    """One request's decayed successes and trials per position, the engine step of its last
    verify that had drafts, and how many probe intervals it waits before the next probe
    (``spec.adaptive``'s probing reads and writes both). Lists replaced, never changed in place."""

    succ: list[float]
    trials: list[float]
    last_drafted_step: int
    probe_backoff: int = 1


@dataclass(slots=True, frozen=True)
class GlobalEvidence:
    """One kind's engine-wide successes and trials per position, decayed through step ``decayed_at``."""

    succ: list[float]
    trials: list[float]
    decayed_at: int


_NO_ROWS: dict = {}


class AcceptanceEstimator:
    def __init__(self, max_k: int, *, prior_alpha: float = 1.0, prior_beta: float = 1.0,
                 prior_strength: float = 2.0, decay: float = 0.95,
                 global_decay: float = 0.99, kind: Hashable = None,
                 evidence: RequestTable | None = None, globals_: EngineRecord | None = None,
                 clock: Callable[[], int] | None = None) -> None:
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
        self.kind = kind
        self.evidence = evidence if evidence is not None else RequestTable("acceptance evidence")
        self.globals = globals_ if globals_ is not None else EngineRecord("acceptance", {})
        self._clock = clock
        self._steps = 0  # decay_global calls (no clock)
        if kind not in self.globals.value:
            self.globals.edit()[kind] = GlobalEvidence([0.0] * self.max_k, [0.0] * self.max_k, self._now())

    # ---- requests ----
    def __contains__(self, request_id: str) -> bool:
        return self.kind in self.evidence.get(request_id, _NO_ROWS)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __iter__(self) -> Iterator[str]:
        kind = self.kind
        return (rid for rid, rows in self.evidence.items() if kind in rows)

    def row(self, request_id: str, step: int = 0) -> Evidence:
        """The evidence of ``request_id``, created empty (at the engine-wide prior) on first use."""
        rows = self.evidence.get(request_id)
        e = rows.get(self.kind) if rows is not None else None
        if e is None:
            e = Evidence([0.0] * self.max_k, [0.0] * self.max_k, step)
            self._set_row(request_id, e, rows)
        return e

    def rows(self, request_ids: Sequence[str], step: int = 0) -> list[Evidence]:
        return [self.row(r, step) for r in request_ids]

    def _set_row(self, request_id: str, e: Evidence, rows: dict | None) -> None:
        new = dict(rows) if rows else {}
        new[self.kind] = e
        self.evidence.set(request_id, new)

    def set_probe_backoff(self, request_id: str, backoff: int) -> None:
        e = self.row(request_id)
        self._set_row(request_id, Evidence(e.succ, e.trials, e.last_drafted_step, backoff),
                      self.evidence.get(request_id))

    def forget(self, request_id: str) -> None:
        """Drop a finished/aborted request's evidence of this kind (its engine-wide share stays)."""
        rows = self.evidence.get(request_id)
        if rows is None or self.kind not in rows:
            return
        rest = {kd: e for kd, e in rows.items() if kd != self.kind}
        if rest:
            self.evidence.set(request_id, rest)
        else:
            self.evidence.drop(request_id)

    # ---- estimates ----
    def global_probs(self) -> list[float]:
        """Engine-wide p_j per position (``max_k`` floats); see the module docstring."""
        n0 = self.prior_alpha + self.prior_beta
        out = []
        prev = self.prior_alpha / n0
        g = self._global()
        for sj, nj in zip(g.succ, g.trials):
            prev = (n0 * prev + sj) / (n0 + nj)
            out.append(prev)
        return out

    def first_position_upper(self) -> float:
        """Engine-wide p_0 plus one posterior standard deviation (Beta): an optimistic value
        for a probe. With little evidence (start-up, or evidence decayed while nobody drafted)
        it is well above the mean, so a probe is tried where drafts might pay; as probes add
        evidence it shrinks to the mean, so probing stops where they do not."""
        g = self._global()
        a = self.prior_alpha + g.succ[0]
        b = self.prior_beta + g.trials[0] - g.succ[0]
        n = a + b
        return min(1.0, a / n + math.sqrt(a * b / (n * n * (n + 1.0))))

    def probs(self, rows: Sequence[Evidence]) -> list[list[float]]:
        """a_{r,j} for the given rows (``max_k`` floats each, in (0, 1))."""
        s = self.prior_strength
        prior = [s * p for p in self.global_probs()]
        return [[(ps + sj) / (s + nj) for ps, sj, nj in zip(prior, e.succ, e.trials)] for e in rows]

    def estimate(self, request_id: str) -> list[float]:
        """a_{r,j} of one request (the engine-wide prior if it has no evidence)."""
        e = self.evidence.get(request_id, _NO_ROWS).get(self.kind)
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
        tested = min(num_draft, num_accepted + 1, self.max_k)
        won = min(num_accepted, self.max_k)
        d = self.decay
        self._set_row(request_id, Evidence([x * d + (j < won) for j, x in enumerate(e.succ)],
                                           [x * d + (j < tested) for j, x in enumerate(e.trials)],
                                           step, e.probe_backoff), self.evidence.get(request_id))
        g = self._global()
        self.globals.edit()[self.kind] = GlobalEvidence([x + (j < won) for j, x in enumerate(g.succ)],
                                                        [x + (j < tested) for j, x in enumerate(g.trials)],
                                                        g.decayed_at)

    def decay_global(self) -> None:
        """Discount engine-wide evidence once per engine step (reverts to the prior when idle),
        for an estimator without a ``clock``. Applied as one factor on the next read: a step where
        nobody drafts (most steps of open chat) then costs nothing here."""
        self._steps += 1

    def _now(self) -> int:
        return self._clock() if self._clock is not None else self._steps

    def _global(self) -> GlobalEvidence:
        """This kind's engine-wide evidence, decayed to the current step (a new record if it was not)."""
        g = self.globals.value[self.kind]
        now = self._now()
        if now > g.decayed_at and self.global_decay < 1.0:
            f = self.global_decay ** (now - g.decayed_at)
            g = GlobalEvidence([x * f for x in g.succ], [x * f for x in g.trials], now)
            self.globals.edit()[self.kind] = g
        return g

    @property
    def global_succ(self) -> list[float]:
        """Engine-wide successes per position (decayed; the list itself: tests write through it)."""
        return self._global().succ

    @property
    def global_trials(self) -> list[float]:
        """Engine-wide trials per position (decayed; the list itself: tests write through it)."""
        return self._global().trials
