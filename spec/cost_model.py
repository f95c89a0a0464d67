"""Step cost model: seconds of one engine step as a function of what the step contains.

The draft-length controller (``spec.adaptive``) trades expected committed tokens against the cost
of the step that verifies them, so it needs the cost of a step *with* the drafts it is about to
choose. Every constant in that cost is learned on the machine, kernel path and thread count the
engine actually runs on: nothing here is a number measured elsewhere.

What a step carries: ``StepShape`` (``spec.step_shape``), whose features the cost is linear in.

Model: ``cost = w . phi(shape)``, ``phi = [1, requests, tokens, logit_rows, attention, hinges...,
draft_requests, draft_rows, tokens_below_team]``,
``w >= 0`` (a cost that falls when rows are added is noise, and would reward padding a step
with useless drafts).

Fit: weighted least squares with relative-error weights ``1 / seconds^2`` (a 1 ms step matters as
much as a 100 ms one: the controller compares ratios), over two sources of evidence:

* the start-up prior: a few steps of chosen shapes timed on the real runner
  (``engine.drafters.step_cost``), fitted alone to prior weights w0, which then act as a Gaussian
  prior: moving w_f away from w0_f costs what the same relative error on a typical probe step
  would cost on ``prior_weight`` online steps. (Not the probes as pseudo-observations: a probe
  of extreme shape, e.g. 256 prefill rows, would then pin its direction far harder than
  ``prior_weight`` steps, because relative errors on it are large when the prior is off.)
* online steps (``update``): every engine step's measured time and shape, discounted by
  ``forget`` per step, so the model follows load and thermal drift in roughly
  ``1 / (1 - forget)`` steps while directions the recent steps do not excite (e.g. draft rows
  when nobody drafted lately) keep the prior's answer instead of drifting.

Non-negativity is enforced by Lawson-Hanson's active-set method on the normal equations. A single
measurement is clipped to within ``max_update_factor`` of the current prediction before it is folded in (a GC pause or a
neighbour's burst must not teach the model that a decode step costs 50 ms).

The controller asks two things: ``cost(shapes)`` and the decomposition ``draft_costs`` that lets
its optimiser price each candidate draft (``spec.adaptive``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from tokenbudget.spec.step_shape import FEATURES, HINGE_KNOTS, TEAM_ROWS, StepShape

_DRAFT_REQUESTS = FEATURES.index("draft_requests")
_BELOW_TEAM = FEATURES.index("tokens_below_team")
_MIN_COST = 1e-9
_RIDGE = 1e-6   # relative to each feature's own diagonal entry: keeps unexcited directions solvable


def _ridged(a: np.ndarray) -> np.ndarray:
    """``a`` with ``_RIDGE`` of each diagonal entry added to it (a floor for the unexcited ones).
    Per feature, not a fraction of the largest entry: one ridge for all would be large against a
    small-valued feature (rows below the team, a few per step, beside attention in the hundreds)
    and let it absorb part of the others' weight."""
    d = np.diag(a)
    return a + np.diag(_RIDGE * np.maximum(d, max(float(np.max(d)), 1e-30) * 1e-12))


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """argmin_{w >= 0} w'Aw - 2b'w for a positive definite A (Lawson-Hanson active set, on the
    normal equations; exact, a handful of small solves for this many features).

    start: a guess of the features with w > 0 (the last fit's: the set rarely changes between
    refits, and then one solve confirms it); used only if its solve is all positive, so the answer
    is the same with or without it."""
    n = len(b)
    w = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    if start is not None and start.any():
        idx = np.flatnonzero(start)
        z = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
        if np.all(z > 0):
            w[idx], free[idx] = z, True
    tol = 1e-12 * max(float(np.max(np.abs(b))), 1e-300)
    for _ in range(3 * n + 10):
        grad = b - a @ w                      # descent direction of the objective (halved)
        bound = ~free
        if not bound.any() or float(np.max(np.where(bound, grad, -np.inf))) <= tol:
            break
        free[int(np.argmax(np.where(bound, grad, -np.inf)))] = True
        while True:
            idx = np.flatnonzero(free)
            z = np.zeros(n)
            z[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if np.all(z[idx] > 0):
                w = z
                break
            neg = np.flatnonzero(free & (z <= 0))
            ratios = w[neg] / (w[neg] - z[neg])
            step = float(np.min(ratios))
            w = w + step * (z - w)
            free[neg[int(np.argmin(ratios))]] = False   # the blocking variable leaves for sure
            free &= w > 0
            w[~free] = 0.0
    return np.maximum(w, 0.0)


class StepCostModel:
    """cost(shape) = w . phi(shape), w >= 0, fitted from a prior and online steps. Not thread-safe.

    forget: discount of online evidence per update (window ~ 1 / (1 - forget) steps).
    prior_weight: online steps the prior is worth in each feature's direction.
    max_update_factor: one online measurement is clipped to [pred / f, pred * f].
    """

    def __init__(self, prior: Iterable[tuple[StepShape, float]], *, forget: float = 0.99,
                 prior_weight: float = 2.0, max_update_factor: float = 3.0,
                 refit_every: int = 32) -> None:
        prior = list(prior)
        if not prior:
            raise ValueError("need at least one (StepShape, seconds) prior measurement")
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        if max_update_factor <= 1.0:
            raise ValueError(f"max_update_factor must be > 1, got {max_update_factor}")
        if refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self.forget = float(forget)
        self.max_update_factor = float(max_update_factor)
        self.refit_every = int(refit_every)
        nf = len(FEATURES)
        a, b = np.zeros((nf, nf)), np.zeros(nf)
        rel = []
        for shape, seconds in prior:
            sec = float(seconds)
            if not (np.isfinite(sec) and sec > 0):
                raise ValueError(f"prior seconds must be finite and > 0, got {seconds}")
            phi = shape.features()
            self._fold_into(a, b, phi, sec, 1.0)
            rel.append(phi / sec)
        self.prior_weights = nonnegative_least_squares(_ridged(a), b)
        # Prior precision per feature: moving w_f by delta changes a typical probe step's cost
        # by delta * phi_f relative to its seconds; that relative error is charged as if
        # ``prior_weight`` steps had seen it (median over the probes that have the feature).
        rel = np.abs(np.array(rel))
        typical = np.array([np.median(col[col > 0]) if np.any(col > 0) else 0.0 for col in rel.T])
        self._prior_precision = float(prior_weight) * typical ** 2
        self._a = np.zeros((nf, nf))
        self._b = np.zeros(nf)
        self._pending: list[tuple[list[float], float]] = []  # (phi, clipped seconds) not yet in _a, _b
        self._w_list: list[float] | None = None               # _w as floats, for the per-step prediction
        self.num_updates = 0
        self.num_refits = 0   # the controller re-plans when the weights change (``spec.adaptive``)
        self._w: np.ndarray | None = None
        self._stale = 0   # updates since the last refit

    @staticmethod
    def _fold_into(a: np.ndarray, b: np.ndarray, phi: np.ndarray, seconds: float, weight: float) -> None:
        w = weight / (seconds * seconds)   # relative error
        a += w * np.outer(phi, phi)
        b += w * seconds * phi

    # ---- the fit ----
    @property
    def weights(self) -> np.ndarray:
        """Current w (seconds per unit of each feature in ``FEATURES``). Refitted after every
        ``refit_every`` updates (a fit, a few small numpy calls, costs about ten choices of drafts:
        benches/RESULTS.md, "Figures behind decisions in the source"; the weights move over
        ~1 / (1 - forget) steps anyway), at once on demand through ``refit``."""
        if self._w is None or self._stale >= self.refit_every:
            self.refit()
        return self._w

    def refit(self) -> None:
        """Solve for w now: online evidence + the Gaussian prior around ``prior_weights``."""
        self.num_refits += 1
        self._stale = 0
        self._fold_pending()
        p = self._prior_precision
        a = self._a + np.diag(p)
        start = None if self._w is None else self._w > 0
        self._w = nonnegative_least_squares(_ridged(a), self._b + p * self.prior_weights, start)
        self._w_list = self._w.tolist()

    def _fold_pending(self) -> None:
        """The updates since the last fold into the normal equations, in one batch: update i of n
        is discounted by forget^(n - 1 - i) and the old evidence by forget^n, as one fold per
        update would do."""
        if not self._pending:
            return
        phi = np.array([f for f, _ in self._pending])
        sec = np.array([s for _, s in self._pending])
        n = len(sec)
        disc = self.forget ** np.arange(n - 1, -1, -1, dtype=np.float64)
        c = disc / (sec * sec)   # relative error, as _fold_into weighs one step
        self._a = self._a * self.forget ** n + (phi * c[:, None]).T @ phi
        self._b = self._b * self.forget ** n + (phi * (c * sec)[:, None]).sum(axis=0)
        self._pending = []

    def coefficients(self) -> dict[str, float]:
        return {name: float(v) for name, v in zip(FEATURES, self.weights)}

    # ---- queries ----
    def cost(self, shape: StepShape) -> float:
        return max(float(shape.features() @ self.weights), _MIN_COST)

    def token_curve(self, base: StepShape, n: int) -> list[float]:
        """Cost of ``base`` plus d = 0..n decode/verify rows of *no* attention cost (the per-row
        part that depends only on the row count; the attention part is per request). Plain
        floats: the controller calls this every step (see ``update``)."""
        w = self._current()
        t0 = base.tokens
        phi = base.phi()
        y0 = sum(x * wf for x, wf in zip(phi, w))
        slope = w[2] + w[3]
        out = [y0 + slope * d for d in range(n + 1)]
        for wk, k, h0 in zip(w[5:], HINGE_KNOTS, phi[5:]):
            if wk > 0:
                for d in range(max(0, k - t0 + 1), n + 1):
                    out[d] += wk * (t0 + d - k - h0)
        wt = w[_BELOW_TEAM]
        if wt > 0 and t0 < TEAM_ROWS:   # rows below the team cost more; the curve drops at TEAM_ROWS
            # (a base already on the team adds 0 at every d: no loop over B * max_k entries)
            for d in range(n + 1):
                out[d] += wt * ((t0 + d if t0 + d < TEAM_ROWS else 0) - phi[_BELOW_TEAM])
        return [y if y > _MIN_COST else _MIN_COST for y in out]

    def is_convex_above(self, tokens: int) -> bool:
        """Whether ``token_curve`` from a step of ``tokens`` rows is convex (non-decreasing
        increments): always, unless rows below the team cost extra and the curve can cross
        ``TEAM_ROWS``, where it drops (a drop under 1 % of a row's cost counts as none: the fit
        leaves such crumbs on a feature the data does not need)."""
        w = self._current()
        return tokens >= TEAM_ROWS or w[_BELOW_TEAM] * TEAM_ROWS <= 0.01 * (w[2] + w[3])

    @property
    def attention_weight(self) -> float:
        """Seconds per thousand attended keys."""
        return self._current()[FEATURES.index("attention")]

    @property
    def drafter_weights(self) -> tuple[float, float]:
        """Seconds per request a model drafter drafts for, and per draft row it runs."""
        w = self._current()
        return w[_DRAFT_REQUESTS], w[_DRAFT_REQUESTS + 1]

    @property
    def version(self) -> int:
        """Changes exactly when the weights do (a refit), pending refits done first."""
        self._current()
        return self.num_refits

    def _current(self) -> list[float]:
        """The weights as floats, refitted first if ``refit_every`` updates are pending."""
        if self._w_list is None or self._stale >= self.refit_every:
            self.refit()
        return self._w_list

    # ---- online ----
    def update(self, shape: StepShape, seconds: float) -> None:
        """Fold one measured step in (``seconds`` clipped near the current prediction)."""
        if not (math.isfinite(seconds) and seconds >= 0) or shape.tokens < 0:
            raise ValueError(f"need finite seconds >= 0 and tokens >= 0, got {seconds}, {shape}")
        if shape.tokens == 0:
            return
        # Plain floats here, numpy once per refit (_fold_pending): this runs every engine step, right
        # after a forward has evicted numpy's code and data from the caches, where one numpy call
        # costs more than this whole update (benches/RESULTS.md, "Controller overhead").
        w = self._current()
        phi = shape.phi()
        pred = max(sum(x * wf for x, wf in zip(phi, w)), _MIN_COST)
        f = self.max_update_factor
        self._pending.append((phi, min(max(float(seconds), pred / f), pred * f)))
        self.num_updates += 1
        self._stale += 1

    def __repr__(self) -> str:
        co = ", ".join(f"{k}={v:.3g}" for k, v in self.coefficients().items() if v > 0)
        return f"StepCostModel({co}; {self.num_updates} updates)"


def synthetic_model(step: float = 0.0, per_request: float = 0.0, per_token: float = 0.0,
                    per_logit_row: float = 0.0, per_kkey: float = 0.0,
                    hinges: Sequence[float] = (), per_draft_request: float = 0.0,
                    per_draft_row: float = 0.0, per_token_below_team: float = 0.0, **kwargs) -> StepCostModel:
    """A model whose prior is generated exactly by the given weights (tests, benches' what-ifs).
    The prior is dense enough over every feature that the fit returns these weights (the drafter
    terms are excited only when one of them is set: a prior like the engine's, whose start-up
    probes draft nothing, otherwise)."""
    w = np.array([step, per_request, per_token, per_logit_row, per_kkey]
                 + list(hinges) + [0.0] * (len(HINGE_KNOTS) - len(hinges))
                 + [per_draft_request, per_draft_row, per_token_below_team])
    if np.any(w < 0):
        raise ValueError("synthetic weights must be >= 0")
    drafted = [(0, 0)] + ([(1, 1), (1, 3), (4, 5)] if per_draft_request or per_draft_row else [])
    prior = []
    for b in (1, 2, 4, 16, 64):
        for t in sorted({b, 2 * b, b + 3, 3 * b + 5, b + 70, b + 300}):
            for lr in sorted({b, t}):
                for att in (0.0, 0.5 * b, 4.0 * b):
                    for dr, dt in drafted:
                        shape = StepShape(b, t, lr, att, dr, dt)
                        prior.append((shape, max(float(shape.features() @ w), _MIN_COST)))
    return StepCostModel(prior, **kwargs)
