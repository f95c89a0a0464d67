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

Storage is slot-based (one row of a 2-D numpy array per live request) so the controller can
gather a whole batch's estimates with one fancy index; ``forget`` frees the row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class AcceptanceEstimator:
    def __init__(self, max_k: int, *, prior_alpha: float = 1.0, prior_beta: float = 1.0,
                 prior_strength: float = 2.0, decay: float = 0.95,
                 global_decay: float = 0.99, initial_slots: int = 64) -> None:
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
        n = max(1, int(initial_slots))
        self._succ = np.zeros((n, self.max_k))
        self._trials = np.zeros((n, self.max_k))
        # Controller bookkeeping per slot: engine step of the last verify that had drafts.
        self.last_drafted_step = np.zeros(n, dtype=np.int64)
        self._slot: dict[str, int] = {}
        self._free: list[int] = list(range(n - 1, -1, -1))
        self._global_succ = np.zeros(self.max_k)
        self._global_trials = np.zeros(self.max_k)
        self._pending_decays = 0  # decay_global calls not yet applied (applied on the next read)

    # ---- slots ----
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def slot(self, request_id: str, step: int = 0) -> int:
        """The row of ``request_id``, created (at the engine-wide prior) on first use."""
        s = self._slot.get(request_id)
        if s is None:
            if not self._free:
                self._grow()
            s = self._free.pop()
            self._succ[s] = 0.0
            self._trials[s] = 0.0
            self.last_drafted_step[s] = step
            self._slot[request_id] = s
        return s

    def slots(self, request_ids: Sequence[str], step: int = 0) -> np.ndarray:
        get = self._slot.get
        out = np.fromiter((get(r, -1) for r in request_ids), dtype=np.int64,
                          count=len(request_ids))
        for i in np.flatnonzero(out < 0):
            out[i] = self.slot(request_ids[i], step)
        return out

    def _grow(self) -> None:
        n = len(self._succ)
        self._succ = np.concatenate([self._succ, np.zeros_like(self._succ)])
        self._trials = np.concatenate([self._trials, np.zeros_like(self._trials)])
        self.last_drafted_step = np.concatenate(
            [self.last_drafted_step, np.zeros_like(self.last_drafted_step)])
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def snapshot(self) -> tuple:
        """What a step's ``decay_global`` and ``slots`` change (for ``restore`` if it fails)."""
        # the engine-wide arrays by reference: this class never changes them in place (it rebinds)
        return (self._global_succ, self._global_trials, self._pending_decays, dict(self._slot), list(self._free),
                len(self._succ))

    def restore(self, saved: tuple) -> None:
        """Back to ``saved``. Rows a failed step allocated return to the free list; their contents
        are irrelevant (a row is zeroed when it is handed out)."""
        self._global_succ, self._global_trials, self._pending_decays, self._slot, self._free, n = saved
        if len(self._succ) != n:  # grown during the step: drop the new rows
            self._succ, self._trials = self._succ[:n].copy(), self._trials[:n].copy()
            self.last_drafted_step = self.last_drafted_step[:n].copy()

    def forget(self, request_id: str) -> None:
        """Drop a finished/aborted request's evidence (its engine-wide share stays)."""
        s = self._slot.pop(request_id, None)
        if s is not None:
            self._free.append(s)

    # ---- estimates ----
    def global_probs(self) -> np.ndarray:
        """Engine-wide p_j per position (shape [max_k]); see the module docstring."""
        n0 = self.prior_alpha + self.prior_beta
        out = np.empty(self.max_k)
        prev = self.prior_alpha / n0
        for j, (sj, nj) in enumerate(zip(self.global_succ.tolist(), self.global_trials.tolist())):
            prev = out[j] = (n0 * prev + sj) / (n0 + nj)
        return out

    def first_position_upper(self) -> float:
        """Engine-wide p_0 plus one posterior standard deviation (Beta): an optimistic value
        for a probe. With little evidence (start-up, or evidence decayed while nobody drafted)
        it is well above the mean, so a probe is tried where drafts might pay; as probes add
        evidence it shrinks to the mean, so probing stops where they do not."""
        a = self.prior_alpha + float(self.global_succ[0])
        b = self.prior_beta + float(self.global_trials[0] - self.global_succ[0])
        n = a + b
        return min(1.0, a / n + float(np.sqrt(a * b / (n * n * (n + 1.0)))))

    def probs(self, slots: np.ndarray) -> np.ndarray:
        """a_{r,j} for the given rows (shape [len(slots), max_k]), each in (0, 1)."""
        s = self.prior_strength
        return (s * self.global_probs() + self._succ[slots]) / (s + self._trials[slots])

    def estimate(self, request_id: str) -> list[float]:
        """a_{r,j} of one request (the engine-wide prior if it has no row)."""
        if request_id not in self._slot:
            return self.global_probs().tolist()
        return self.probs(np.array([self._slot[request_id]]))[0].tolist()

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
        s = self.slot(request_id, step)
        self.last_drafted_step[s] = step
        tested = min(num_draft, num_accepted + 1, self.max_k)
        won = min(num_accepted, self.max_k)
        succ, trials = self._succ[s], self._trials[s]
        succ *= self.decay
        trials *= self.decay
        trials[:tested] += 1.0
        succ[:won] += 1.0
        gt, gs = self.global_trials.copy(), self.global_succ.copy()  # rebound, never changed in place
        gt[:tested] += 1.0
        gs[:won] += 1.0
        self._global_trials, self._global_succ = gt, gs

    def decay_global(self) -> None:
        """Discount engine-wide evidence once per engine step (reverts to the prior when idle).
        Counted here and applied as one factor on the next read: a step where nobody drafts (most
        steps of open chat) then costs no numpy call."""
        self._pending_decays += 1

    def _apply_decays(self) -> None:
        if self._pending_decays and self.global_decay < 1.0:
            f = self.global_decay ** self._pending_decays
            self._global_succ = self._global_succ * f
            self._global_trials = self._global_trials * f
        self._pending_decays = 0

    @property
    def global_succ(self) -> np.ndarray:
        """Engine-wide successes per position (decayed; the array itself, writable)."""
        self._apply_decays()
        return self._global_succ

    @property
    def global_trials(self) -> np.ndarray:
        """Engine-wide trials per position (decayed; the array itself, writable)."""
        self._apply_decays()
        return self._global_trials

