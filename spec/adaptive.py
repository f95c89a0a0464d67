"""Speculation-length controller: per step, drafts per request that maximise tokens per second.

Objective. For drafts k = (k_1..k_B) over the B decoding requests of the next step,

    maximise  R(k) = sum_i E_i(k_i) / C(k)

with E_i(k) = 1 + sum_{j<k} m_{i,j},  m_{i,j} = prod_{l<=j} a_{i,l}  (expected committed tokens:
accepted drafts plus the bonus/recovered token), a_{i,l} the per-request conditional acceptance
estimates (``spec.acceptance``) and C(k) the cost of the whole step carrying those drafts as the
engine measures it (``spec.cost_model``: learned online from this engine's own steps, seeded by a
start-up probe; no cost constant is set by hand). In that model a draft j of request i adds one
row and one logit row (a cost g(D) that depends only on the step's total drafts D, convex in D)
plus its attention over the request's context (c_{i,j} = w_attention * keys, per request: a
verify row of a long-context request costs more than one of a short chat). So

    C(k) = g(D) + sum_{i, j < k_i} c_{i,j}.

Exact algorithm (``optimal_draft_lengths``, Dinkelbach's method for a ratio): R* is the largest
lambda with F(lambda) = max_k [N(k) - lambda C(k)] >= 0. For a fixed lambda, each candidate draft
has value v_{i,j} = m_{i,j} - lambda c_{i,j}; within a row v is non-increasing in j (m falls, c
grows with the keys), so for any D the D largest values, ties to the lower position, form a union
of prefixes (a valid k), and no other D drafts have a larger sum; scanning D over the sorted prefix
sums with - lambda g(D) gives F(lambda) exactly. Start at lambda = R(0) (no drafts), set lambda to
the ratio of the maximiser and repeat: each round strictly raises R until F(lambda) = 0, which is
the global optimum (finite: there are finitely many k). Ties pick the smallest D (less
speculation). Cost: a few sorts of <= B*K numbers (figures: benches/RESULTS.md, "Figures behind
decisions in the source").

What falls out: k = 0 for requests whose drafts do not pay (low m or long context); shorter k
as the batch grows (a draft must return more than the step's average cost per token, which
falls with B); k = 0 for everyone when no draft raises R (a compute-bound step where a verify row
costs more than it returns).

Staleness and probing. A request at k = 0 produces no evidence, so its low estimate would
stick. Two mechanisms let drafting resume: (1) evidence decays (``spec.acceptance``); (2) probing:
a request that has had no drafted verify for ``probe_interval`` steps (and whose cap allows
drafts) is a probe candidate; probes are one draft each, valued at the engine-wide first-position
rate p_0, and the controller adds the number of probes (most overdue first) that maximises R given
the chosen plan — so probes are spent only where speculation could pay at the current batch size
and cost. ``probe_interval=0`` disables probing.

Per-request control: ``Request.max_spec_tokens`` (None = engine default ``max_k``, 0 = never)
caps k_i; ``choose(..., caps=...)`` takes further caps (``scheduler.drafts.draft_limit``, or the
length of the drafts a free drafter actually found) so the plan counts no clipped drafts.

Engine integration (``spec.speculator`` is the glue): ``choose`` before the step with the step's
other work as ``base`` (a ``StepShape``), ``observe`` per verified request and ``observe_step``
with the step's shape and measured seconds after the commit, ``forget`` when a request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenbudget.scheduler.request import Request
from tokenbudget.spec.acceptance import AcceptanceEstimator
from tokenbudget.spec.cost_model import StepCostModel, StepShape

CurveFn = Callable[[np.ndarray], np.ndarray]
_EMPTY = StepShape(0, 0, 0, 0.0)


@dataclass(slots=True)
class Plan:
    """The last ``choose`` result: per-request k, expected committed tokens, step cost, ratio."""

    k: list[int]
    expected_tokens: float
    cost: float
    ratio: float
    num_probes: int = 0


def expected_tokens(accept_probs: np.ndarray, k: np.ndarray) -> np.ndarray:
    """E_i(k_i) = 1 + sum_{j<k_i} prod_{l<=j} a_{i,l} for each row."""
    m = np.cumprod(accept_probs, axis=1)
    mask = np.arange(m.shape[1])[None, :] < np.asarray(k)[:, None]
    return 1.0 + (m * mask).sum(axis=1)


def optimal_draft_lengths(accept_probs: np.ndarray, caps: np.ndarray, curve: CurveFn,
                          row_costs: np.ndarray | None = None, max_rounds: int = 64
                          ) -> tuple[np.ndarray, float, float]:
    """Exact maximiser of R(k) (module docstring). Returns (k, numerator, denominator).

    accept_probs: [B, K] conditional acceptance probabilities in [0, 1].
    caps: [B] upper bounds on k_i (clipped to [0, K]).
    curve: g(D) for an int array of total drafts D (vectorised, > 0).
    row_costs: [B, K] c_{i,j} >= 0, non-decreasing along each row (None: all 0).
    """
    a = np.asarray(accept_probs, dtype=np.float64)
    b, kmax = a.shape
    caps = np.minimum(np.maximum(np.asarray(caps, dtype=np.int64), 0), kmax)
    marg = np.cumprod(a, axis=1)
    valid = np.arange(kmax)[None, :] < caps[:, None]
    rows = np.nonzero(valid)[0]
    gains = marg[valid]                               # row-major: lower position first per row
    costs = np.zeros_like(gains) if row_costs is None else np.asarray(row_costs, np.float64)[valid]
    g = np.asarray(curve(np.arange(len(gains) + 1)), dtype=np.float64)
    if np.any(g <= 0) or np.any(costs < 0):
        raise ValueError("step cost must be > 0 and draft costs >= 0")
    sel = np.zeros(0, dtype=np.int64)
    num, den = float(b), float(g[0])
    for _ in range(max_rounds):
        lam = num / den
        v = gains - lam * costs
        order = np.argsort(-v, kind="stable")        # stable: ties keep the lower position first
        f = np.concatenate(([0.0], np.cumsum(v[order]))) - lam * g
        d = int(np.argmax(f))                         # first maximum: the smallest D
        cand = order[:d]
        cnum = b + float(gains[cand].sum())
        cden = float(g[d] + costs[cand].sum())
        if cnum / cden <= lam * (1.0 + 1e-12):
            break
        sel, num, den = cand, cnum, cden
    k = np.bincount(rows[sel], minlength=b)
    return k, num, den


class AdaptiveSpecController:
    """Chooses drafts per request per step; learns acceptance and step cost online. Not
    thread-safe.

    max_k: upper bound on drafts per request (``SpeculativeConfig.max_spec_tokens``).
    cost_model: this engine's ``StepCostModel`` (``engine.worker.step_cost`` measures the prior).
    prior_alpha / prior_beta: engine-wide Beta prior of per-position acceptance (pseudo-counts).
    prior_strength: pseudo-trials of the engine-wide figure in each request's prior.
    decay / global_decay: evidence discount per verify (request) / per step (engine-wide).
    probe_interval: steps without a drafted verify before a request may be probed (0 = never).
    """

    def __init__(self, max_k: int, cost_model: StepCostModel, *, prior_alpha: float = 1.0,
                 prior_beta: float = 1.0, prior_strength: float = 2.0, decay: float = 0.95,
                 global_decay: float = 0.99, probe_interval: int = 8) -> None:
        if probe_interval < 0:
            raise ValueError(f"probe_interval must be >= 0, got {probe_interval}")
        self.max_k = int(max_k)
        self.acceptance = AcceptanceEstimator(
            max_k, prior_alpha=prior_alpha, prior_beta=prior_beta,
            prior_strength=prior_strength, decay=decay, global_decay=global_decay)
        self.cost_model = cost_model
        self.probe_interval = int(probe_interval)
        self.step = 0
        self.k_histogram: dict[int, int] = {}
        self.num_probes = 0
        self.last_plan: Plan | None = None

    @classmethod
    def from_config(cls, config: Any, cost_model: StepCostModel, **kwargs: Any
                    ) -> AdaptiveSpecController:
        """From a ``SpeculativeConfig``: max_k = ``config.max_spec_tokens``."""
        return cls(config.max_spec_tokens, cost_model, **kwargs)

    # ---- the per-step decision ----
    def caps_for(self, requests: Sequence[Request], caps: Sequence[int] | None = None
                 ) -> np.ndarray:
        """min(max_k, Request.max_spec_tokens, caps[i]) per request."""
        out = np.fromiter((self.max_k if r.max_spec_tokens is None else r.max_spec_tokens
                           for r in requests), dtype=np.int64, count=len(requests))
        if caps is not None:
            if len(caps) != len(requests):
                raise ValueError(f"caps has {len(caps)} entries for {len(requests)} requests")
            out = np.minimum(out, np.asarray(caps, dtype=np.int64))
        return np.minimum(np.maximum(out, 0), self.max_k)

    def step_costs(self, requests: Sequence[Request], base: StepShape = _EMPTY
                   ) -> tuple[CurveFn, np.ndarray]:
        """g(D) and c_{i,j} for these decoding requests on top of ``base`` (module docstring).

        Request i decodes one row after ``num_computed_tokens`` cached tokens; its draft j is the
        row after that and attends ``context + j + 2`` keys."""
        ctx = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.float64,
                          count=len(requests))
        b = len(requests)
        decode_keys = float(ctx.sum() + b) / 1000.0          # request_attention(ctx, 1) each
        zero = StepShape(base.requests + b, base.tokens + b, base.logit_rows + b,
                         base.attention + decode_keys)
        model = self.cost_model

        def curve(d: np.ndarray) -> np.ndarray:
            return model.token_curve(zero, d)
        j = np.arange(self.max_k, dtype=np.float64)
        row_costs = model.attention_weight * (ctx[:, None] + j[None, :] + 2.0) / 1000.0
        return curve, row_costs

    def choose(self, requests: Sequence[Request], base: StepShape | None = None,
               caps: Sequence[int] | None = None) -> list[int]:
        """Drafts to propose for each request next step (``0 <= k_i <= cap_i``).

        base: what the step carries besides the listed requests' 1 + k_i rows (prefill chunks,
        non-speculating requests). Call once per engine step.
        """
        base = _EMPTY if base is None else base
        if base.tokens < 0 or base.requests < 0 or base.logit_rows < 0 or base.attention < 0:
            raise ValueError(f"base must have no negative field, got {base}")
        self.step += 1
        self.acceptance.decay_global()
        b = len(requests)
        if b == 0:
            self.last_plan = Plan([], 0.0, 0.0, 0.0)
            return []
        if caps is not None and not any(caps):  # nothing to draft (no n-gram match): no choice, no numpy
            if len(caps) != b:
                raise ValueError(f"caps has {len(caps)} entries for {b} requests")
            self.last_plan = Plan([0] * b, float(b), 0.0, 0.0)
            self.k_histogram[0] = self.k_histogram.get(0, 0) + b
            return self.last_plan.k
        cap = self.caps_for(requests, caps)
        if not cap.any():                  # nothing to draft (every request capped at 0): no choice
            self.last_plan = Plan([0] * b, float(b), 0.0, 0.0)
            self.k_histogram[0] = self.k_histogram.get(0, 0) + b
            return self.last_plan.k
        slots = self.acceptance.slots([r.request_id for r in requests], self.step)
        probs = self.acceptance.probs(slots)
        curve, row_costs = self.step_costs(requests, base)
        k, num, den = optimal_draft_lengths(probs, cap, curve, row_costs)
        n_probes, num, den = self._add_probes(k, cap, slots, num, den, curve, row_costs)
        self.last_plan = Plan(k.tolist(), num, den, num / den, n_probes)
        hist = self.k_histogram
        for kv in self.last_plan.k:
            hist[kv] = hist.get(kv, 0) + 1
        return self.last_plan.k

    def _add_probes(self, k: np.ndarray, cap: np.ndarray, slots: np.ndarray, num: float,
                    den: float, curve: CurveFn, row_costs: np.ndarray) -> tuple[int, float, float]:
        """Give k=1 to the overdue idle requests worth probing (modifies ``k``); returns their
        number and the plan's new numerator and denominator."""
        if self.probe_interval == 0:
            return 0, num, den
        idle = self.step - self.acceptance.last_drafted_step[slots]
        cand = np.flatnonzero((k == 0) & (cap >= 1) & (idle >= self.probe_interval))
        if len(cand) == 0:
            return 0, num, den
        cand = cand[np.argsort(-idle[cand], kind="stable")]
        p0 = float(self.acceptance.global_probs()[0])
        hope = self.acceptance.first_position_upper()   # decide optimistically, report the mean
        d0 = int(k.sum())
        m = np.arange(len(cand) + 1)
        lin = den - float(curve(np.array([d0]))[0])
        dens = curve(d0 + m) + lin + np.concatenate(([0.0], np.cumsum(row_costs[cand, 0])))
        ratio = (num + hope * m) / dens
        n = int(np.argmax(ratio))
        if n:
            k[cand[:n]] = 1
            self.num_probes += n
        return n, num + p0 * n, float(dens[n])

    # ---- transactions ----
    def snapshot(self) -> tuple:
        """Everything ``choose`` changes, so a failed engine step can put it back."""
        return (self.step, self.acceptance.snapshot(), dict(self.k_histogram), self.num_probes,
                self.last_plan)

    def restore(self, saved: tuple) -> None:
        self.step, acceptance, self.k_histogram, self.num_probes, self.last_plan = saved
        self.acceptance.restore(acceptance)

    # ---- feedback ----
    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """After the commit: the request verified ``num_draft``, kept ``num_accepted``."""
        self.acceptance.observe(request_id, num_draft, num_accepted, self.step)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """The engine's measured step: it carried ``shape`` and took ``seconds``."""
        self.cost_model.update(shape, seconds)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted; free its state."""
        self.acceptance.forget(request_id)

    def estimate(self, request_id: str) -> list[float]:
        """Current per-position conditional acceptance estimate of ``request_id``."""
        return self.acceptance.estimate(request_id)
