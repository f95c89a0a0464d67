"""Step cost model c(T): seconds of one target forward (+ sampling/verify) carrying T tokens.

The speculation-length controller (``spec.adaptive``) trades expected committed tokens against
the cost of the step that verifies them, so it needs c(T) for T = every token the step carries
(decode tokens, drafts, prefill chunks).

How it is built:

* At start-up the runner times a few forward passes at token counts in a small grid
  (``measure_step_costs(run_forward, default_grid(max_num_batched_tokens))``): warm-up calls
  first, then the median of ``repeats`` timed calls per grid point.
* Online, the engine reports each step's measured time and total token count (``update``). A
  measurement is assigned to the nearest bucket (grid point) after shifting it along the current
  curve (``seconds + c(g) - c(T)``), then folded into that bucket's exponentially-weighted mean
  (weight ``ewma``). A single update moves a bucket by at most a factor ``max_update_factor``
  (guards against a GC pause or a one-off compile). Token counts beyond the measured range by
  more than 25 % open a new bucket, so the model learns the range start-up did not measure.
* Load drift (``scale_ewma`` > 0): on a shared or thermally throttled machine every step gets
  slower or faster together, but each bucket only hears about it when a step of its size runs.
  Buckets refreshed at different times then disagree about the load, and the controller, which
  only uses ratios c(T + D) / c(T), reads the drift as a cost of drafting (e.g. bucket 8 updated
  under load by code prompts, bucket 1 last updated when the box was quiet). So each update also
  rescales every bucket by ``1 + scale_ewma * (r - 1)``, r = seconds / c(T) (clipped like any
  update): the shape is learned per bucket, the level by all of them. 0 (the default) keeps the
  buckets independent.
* ``cost(T)`` interpolates piecewise-linearly between buckets. Above the last bucket it
  extrapolates with the last segment's slope (a flat extrapolation would make large steps look
  free and invite over-speculation); below the first bucket it is flat.
* Monotone non-decreasing is enforced: the bucket means are projected onto non-decreasing
  sequences by weighted isotonic regression (pool-adjacent-violators, weights = number of
  measurements per bucket, capped) each time they change. A cost that falls when tokens are added
  is measurement noise, and a non-monotone c(T) would reward padding steps with useless drafts.

* Requests per step (``per_request``): on a backend with per-request overhead (the torch
  attention path loops over requests in Python; each request also attends over its own context)
  a step of B requests carrying T tokens costs more than one request of T tokens. The model is
  additive, ``cost(T, B) = h(T) + per_request * (B - 1)``, h the bucketed curve above (measured on
  one request, so B = 1 is the old model). An update that says how many requests the step had
  (``update(T, seconds, num_requests=B)``) regresses the residual ``seconds - h(T)`` on
  ``B - 1`` (through the origin, exponentially weighted sufficient statistics with weight
  ``per_request_ewma``, seeded by the start-up probe with ``per_request_prior`` pseudo-steps) and
  feeds only ``seconds - per_request * (B - 1)`` into h, so multi-request steps no longer inflate
  the T curve. For a fixed batch the term is a constant, so the controller's objective still
  varies only through T. Updates without ``num_requests`` leave the term alone (old behaviour).

Units are whatever the caller measures (seconds from ``time.perf_counter``); the controller only
uses ratios, but target and drafter costs must share a unit. ``run_forward`` must block until the
device has finished (e.g. call ``torch.cuda.synchronize()``), or the timings measure launch only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

_MIN_COST = 1e-12
_WEIGHT_CAP = 50.0  # a bucket's weight in the isotonic fit stops growing here


def default_grid(max_tokens: int) -> list[int]:
    """Powers of two up to ``max_tokens``, plus ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    grid, t = [], 1
    while t < max_tokens:
        grid.append(t)
        t *= 2
    grid.append(max_tokens)
    return grid


def isotonic_non_decreasing(y: Sequence[float], w: Sequence[float]) -> np.ndarray:
    """Weighted least-squares projection of ``y`` onto non-decreasing sequences (PAV)."""
    vals: list[float] = []
    wts: list[float] = []
    lens: list[int] = []
    for yi, wi in zip(y, w):
        vals.append(float(yi))
        wts.append(float(wi))
        lens.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            wsum = wts[-2] + wts[-1]
            v = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / wsum
            n = lens[-2] + lens[-1]
            del vals[-1], wts[-1], lens[-1]
            vals[-1], wts[-1], lens[-1] = v, wsum, n
    return np.repeat(np.array(vals, dtype=np.float64), lens)


class StepCostModel:
    """c(T) from bucketed measurements. Safe to call ``cost`` at any time after construction.

    tokens / seconds: bucket positions (distinct token counts >= 1) and their mean cost.
    counts: measurements behind each bucket (weights of the isotonic fit); default 1 each.
    ewma: weight of one online measurement in its bucket's mean.
    """

    def __init__(self, tokens: Sequence[int], seconds: Sequence[float],
                 counts: Sequence[float] | None = None, *, ewma: float = 0.1,
                 max_update_factor: float = 3.0, max_buckets: int = 64,
                 scale_ewma: float = 0.0, per_request: float = 0.0,
                 per_request_ewma: float = 0.02, per_request_prior: float = 20.0) -> None:
        if len(tokens) == 0 or len(tokens) != len(seconds):
            raise ValueError("tokens and seconds must be non-empty and of equal length")
        if not 0.0 < ewma <= 1.0:
            raise ValueError(f"ewma must be in (0, 1], got {ewma}")
        if max_update_factor <= 1.0:
            raise ValueError(f"max_update_factor must be > 1, got {max_update_factor}")
        t = np.asarray(tokens, dtype=np.float64)
        s = np.asarray(seconds, dtype=np.float64)
        if np.any(t < 1) or len(np.unique(t)) != len(t):
            raise ValueError(f"tokens must be distinct and >= 1, got {list(tokens)}")
        if not np.all(np.isfinite(s)) or np.any(s < 0):
            raise ValueError(f"seconds must be finite and >= 0, got {list(seconds)}")
        order = np.argsort(t)
        self._t = t[order]
        self._raw = s[order]
        c = np.ones(len(t)) if counts is None else np.asarray(counts, dtype=np.float64)[order]
        self._n = c
        self.ewma = float(ewma)
        if not 0.0 <= scale_ewma <= 1.0:
            raise ValueError(f"scale_ewma must be in [0, 1], got {scale_ewma}")
        self.max_update_factor = float(max_update_factor)
        self.scale_ewma = float(scale_ewma)
        self.max_buckets = int(max_buckets)
        self.num_updates = 0
        if not (np.isfinite(per_request) and per_request >= 0):
            raise ValueError(f"per_request must be finite and >= 0, got {per_request}")
        if not 0.0 < per_request_ewma <= 1.0:
            raise ValueError(f"per_request_ewma must be in (0, 1], got {per_request_ewma}")
        if per_request_prior < 0:
            raise ValueError(f"per_request_prior must be >= 0, got {per_request_prior}")
        self.per_request_ewma = float(per_request_ewma)
        self.per_request_prior = float(per_request_prior)
        # Weighted sums of x^2 and x * residual (x = B - 1) behind per_request = sxy / sxx.
        self._sxx = 0.0
        self._sxy = 0.0
        self.per_request = float(per_request)
        self._refit()

    # ---- per-request term ----
    def set_per_request(self, value: float, weight: float | None = None,
                        scale: float = 1.0) -> None:
        """Seed the per-request term with ``value`` worth ``weight`` pseudo-steps (default
        ``per_request_prior``) of ``scale`` extra requests each."""
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"per_request must be finite and >= 0, got {value}")
        w = self.per_request_prior if weight is None else float(weight)
        self.per_request = float(value)
        self._sxx = w * scale * scale
        self._sxy = self._sxx * self.per_request

    def fit_per_request(self, measurements: Iterable[tuple[int, int, float]], *,
                        weight: float | None = None) -> float:
        """Least-squares per-request term from (tokens, requests, seconds) measurements:
        residuals ``seconds - h(tokens)`` regressed on ``requests - 1`` through the origin
        (clipped at 0). Seeds the online estimate; returns it."""
        xs, rs = [], []
        for t, b, sec in measurements:
            xs.append(float(b) - 1.0)
            rs.append(float(sec) - float(self.cost(t)))
        x, r = np.asarray(xs), np.asarray(rs)
        sxx = float(np.dot(x, x))
        if sxx <= 0:
            return self.per_request
        value = max(float(np.dot(x, r)) / sxx, 0.0)
        self.set_per_request(value, weight, scale=float(np.sqrt(sxx / len(x))))
        return self.per_request

    def _update_per_request(self, x: float, residual: float) -> None:
        lam = self.per_request_ewma
        self._sxx = (1.0 - lam) * self._sxx + lam * x * x
        self._sxy = (1.0 - lam) * self._sxy + lam * x * residual
        self.per_request = max(self._sxy / self._sxx, 0.0) if self._sxx > 0 else 0.0

    # ---- construction ----
    @classmethod
    def from_measurements(cls, measurements: Iterable[tuple[int, float]],
                          **kwargs) -> StepCostModel:
        """One bucket per distinct T holding the mean of its measurements."""
        groups: dict[int, list[float]] = {}
        for t, s in measurements:
            groups.setdefault(int(t), []).append(float(s))
        if not groups:
            raise ValueError("need at least one (tokens, seconds) measurement")
        ts = sorted(groups)
        return cls(ts, [statistics.fmean(groups[t]) for t in ts],
                   [len(groups[t]) for t in ts], **kwargs)

    @classmethod
    def linear(cls, fixed: float, per_token: float, max_tokens: int = 8192,
               knee_tokens: int = 0, **kwargs) -> StepCostModel:
        """Synthetic roofline: ``fixed`` up to ``knee_tokens``, then + ``per_token`` each."""
        grid = set(default_grid(max_tokens))
        if knee_tokens >= 1:
            grid.add(knee_tokens)
        grid = sorted(grid)
        return cls(grid, [fixed + per_token * max(0, t - knee_tokens) for t in grid], **kwargs)

    # ---- queries ----
    @property
    def points(self) -> list[tuple[int, float]]:
        """(T, fitted monotone cost) per bucket."""
        return [(int(t), float(c)) for t, c in zip(self._t, self._fit)]

    def cost(self, tokens, num_requests=None):
        """c(T) for an int or an array of token counts (array in, array out); with
        ``num_requests`` = B (int or array) adds ``per_request * (B - 1)``."""
        y = self._h(tokens)
        if num_requests is not None and self.per_request > 0:
            extra = self.per_request * np.maximum(np.asarray(num_requests, dtype=np.float64) - 1, 0)
            y = y + extra
            if np.ndim(y) == 0:
                y = float(y)
        return y

    def _h(self, tokens):
        x = np.asarray(tokens, dtype=np.float64)
        y = np.interp(x, self._t, self._fit)
        if len(self._t) > 1:
            slope = (self._fit[-1] - self._fit[-2]) / (self._t[-1] - self._t[-2])
            y = np.where(x > self._t[-1], self._fit[-1] + slope * (x - self._t[-1]), y)
        y = np.maximum(y, _MIN_COST)
        return float(y) if y.ndim == 0 else y

    __call__ = cost

    # ---- online refinement ----
    def update(self, tokens: int, seconds: float, num_requests: int | None = None) -> None:
        """Fold one measured step (``tokens`` total tokens took ``seconds``) into the model.

        With ``num_requests`` (requests in the step) the per-request term learns from the
        residual over h(T) and h hears only ``seconds - per_request * (num_requests - 1)``."""
        if tokens < 1 or not np.isfinite(seconds) or seconds < 0:
            raise ValueError(f"need tokens >= 1 and finite seconds >= 0, got {tokens}, {seconds}")
        self.num_updates += 1
        t = float(tokens)
        if num_requests is not None and num_requests > 1:
            x = float(num_requests) - 1.0
            h = float(self._h(t))
            pred = h + self.per_request * x
            f = self.max_update_factor
            # one-off stalls move it little; no clip before the term has any evidence
            clipped = min(max(seconds, pred / f), pred * f) if self._sxx > 0 else seconds
            self._update_per_request(x, clipped - h)
            seconds = max(seconds - self.per_request * x, 0.0)
        if self.scale_ewma > 0:
            r = seconds / float(self.cost(t))
            r = min(max(r, 1.0 / self.max_update_factor), self.max_update_factor)
            f = 1.0 + self.scale_ewma * (r - 1.0)
            self._raw = self._raw * f
            self._fit = np.maximum(self._fit * f, _MIN_COST)
        if len(self._t) < self.max_buckets and (t > 1.25 * self._t[-1] or t * 1.25 < self._t[0]):
            self._insert(t, seconds)
            return
        i = int(np.searchsorted(self._t, t))
        if i == len(self._t) or (i > 0 and t - self._t[i - 1] <= self._t[i] - t):
            i -= 1
        shifted = seconds + self._fit[i] - float(self.cost(t))
        old = self._raw[i]
        if old > 0:
            shifted = min(max(shifted, old / self.max_update_factor), old * self.max_update_factor)
        self._raw[i] = old + self.ewma * (max(shifted, 0.0) - old)
        self._n[i] += 1
        self._refit()

    def _insert(self, t: float, seconds: float) -> None:
        i = int(np.searchsorted(self._t, t))
        self._t = np.insert(self._t, i, t)
        self._raw = np.insert(self._raw, i, seconds)
        self._n = np.insert(self._n, i, 1.0)
        self._refit()

    def _refit(self) -> None:
        fit = isotonic_non_decreasing(self._raw, np.minimum(self._n, _WEIGHT_CAP))
        self._fit = np.maximum(fit, _MIN_COST)

    def __repr__(self) -> str:
        pts = ", ".join(f"{t}:{c:.3g}" for t, c in self.points)
        extra = f", per_request={self.per_request:.3g}" if self.per_request else ""
        return f"StepCostModel([{pts}]{extra})"


def measure_step_costs(run_forward: Callable[[int], None], grid: Iterable[int], *,
                       warmup: int = 1, repeats: int = 3,
                       timer: Callable[[], float] = time.perf_counter,
                       **kwargs) -> StepCostModel:
    """Time ``run_forward(T)`` for every T in ``grid`` and build a ``StepCostModel``.

    Per grid point: ``warmup`` untimed calls (allocator growth, autotuning, graph capture), then
    ``repeats`` timed calls; the bucket holds their median (robust to a stray slow call).
    ``run_forward`` must run one full step carrying T tokens and block until it is done.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    measurements: list[tuple[int, float]] = []
    for t in sorted(set(int(g) for g in grid)):
        if t < 1:
            raise ValueError(f"grid token counts must be >= 1, got {t}")
        for _ in range(warmup):
            run_forward(t)
        times = []
        for _ in range(repeats):
            start = timer()
            run_forward(t)
            times.append(timer() - start)
        measurements.append((t, statistics.median(times)))
    if not measurements:
        raise ValueError("grid is empty")
    return StepCostModel.from_measurements(measurements, **kwargs)
