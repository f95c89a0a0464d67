"""Speculation-length controller: per step, drafts per request that maximise tokens per second.

Objective. For drafts k = (k_1..k_B) over the B decoding requests of the next step,

    maximise  R(k) = sum_i E_i(k_i) / ( c(T_base + sum_i (1 + k_i), B_step) + d(sum_i k_i) )

with E_i(k) = 1 + sum_{j<k} m_{i,j},  m_{i,j} = prod_{l<=j} a_{i,l}  (expected committed tokens:
accepted drafts plus the bonus/recovered token), a_{i,l} the per-request conditional acceptance
estimates (``spec.acceptance``), c the target step cost (``spec.cost_model``), d the drafter
cost (0 for n-gram/suffix, per draft token for a draft model), T_base the step's other tokens,
B_step = B + the step's other requests. The cost model is additive, c(T, B) = h(T) +
per_request * (B - 1) (``StepCostModel``); B_step is fixed within a step, so c is a function of
T alone there and the exact algorithm below applies unchanged.

Exact algorithm (``optimal_draft_lengths``). Both cost terms depend on k only through the total
D = sum_i k_i. For a fixed D the denominator is fixed, so the best k for that D maximises the
numerator B + (sum of the chosen m_{i,j}), where the chosen entries must form a prefix of each
row (k_i drafts contribute m_{i,0..k_i-1}). Each row is non-increasing
(m_{i,j+1} = m_{i,j} * a_{i,j+1} <= m_{i,j} since a is in [0, 1]), so the D globally largest
entries, ties broken toward the lower position, are a union of prefixes: if m_{i,j} is taken,
every m_{i,l} with l < j is >= it and ranks before it, so it is taken too. No D entries can sum
to more than the D largest, so this set is optimal among all assignments with total D. Every
assignment has some D in 0..sum(caps), so scanning all D over the sorted marginals' prefix sums
and keeping the best ratio finds the global optimum. Nothing is assumed about c or d (not even
monotonicity) beyond positivity; ties in R pick the smallest D (less speculation). Cost is one
sort of <= B*K numbers plus vectorised prefix sums (figures:
benches/RESULTS.md, "Figures behind decisions in the source").

k = 0 for everyone falls out when no D > 0 raises R: large batches on a compute-bound target
(c grows ~linearly in T, so an extra token costs about as much as the ~1 token each request
already yields) or acceptance ~0.

Staleness and probing. A request at k = 0 produces no evidence, so its low estimate would
stick. Two mechanisms let drafting resume: (1) evidence decays (see ``spec.acceptance``):
per-request evidence per verify, engine-wide evidence per step back to the configured Beta prior;
(2) probing: a request that has had no drafted verify for ``probe_interval`` steps (and whose
cap allows drafts) is a probe candidate; probes are one draft each, valued at the engine-wide
first-position rate p_0, and the controller adds the number of probes (most overdue first) that
maximises R given the chosen plan — so probes are only spent where speculation could pay at the
current batch size and cost (none on a compute-bound large batch). A probe's outcome updates the
request's estimate; once it is good again the optimiser gives it drafts on its own.
``probe_interval=0`` disables probing.

Per-request control: ``Request.max_spec_tokens`` (None = engine default ``max_k``, 0 = never)
caps k_i; ``choose(..., caps=...)`` takes further caps (e.g. ``spec.proposer.draft_limit``
for the request's remaining length) so the plan does not count drafts that would be clipped.

Engine integration (one step; only when ``SpeculativeConfig.is_adaptive``; ``spec.speculator``
is the glue that does the per-request part):

    ctrl = AdaptiveSpecController.from_config(spec_config, cost_model=measure_step_costs(
               runner_forward, default_grid(max_num_batched_tokens)))   # at start-up
    ...
    sched = scheduler.schedule(); out = runner.execute(sched)            # timed: seconds
    ctrl.observe_step(sched.total_num_scheduled_tokens, seconds,
                      num_requests=len(sched.scheduled))                 # cost_model.update
    outputs = scheduler.update_from_output(sched, out)
    for o in outputs: ctrl.observe(o.request_id, o.num_draft_tokens, o.num_accepted_tokens)
    for each finished/aborted request r: ctrl.forget(r.request_id)
    reqs = running requests that are decoding
    ks = ctrl.choose(reqs, base_tokens=<next step's other tokens, e.g. pending prefill>,
                     caps=[draft_limit(r, max_model_len) for r in reqs],   # caps optional
                     base_requests=<next step's other requests>)
    drafts = proposer.propose(reqs, ks)                                  # k_i = 0: skip
    scheduler.update_draft_token_ids({r.request_id: d for r, d in zip(reqs, drafts) if d})

The proposer may return fewer than k_i drafts; ``observe`` uses what was verified. For a draft
model pass ``drafter_cost`` (seconds per draft token, or a ``StepCostModel`` over D).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenbudget.scheduler.request import Request
from tokenbudget.spec.acceptance import AcceptanceEstimator
from tokenbudget.spec.cost_model import StepCostModel

CostFn = Callable[[np.ndarray], np.ndarray]


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


def optimal_draft_lengths(accept_probs: np.ndarray, caps: np.ndarray, base_tokens: int,
                          cost: CostFn, drafter_cost: CostFn | None = None,
                          min_gain: float = 0.0) -> tuple[np.ndarray, float, float]:
    """Exact maximiser of R(k) (see the module docstring). Returns (k, numerator, denominator).

    accept_probs: [B, K] conditional acceptance probabilities in [0, 1].
    caps: [B] per-request upper bounds on k_i (clipped to [0, K]).
    cost / drafter_cost: vectorised over an int array of total tokens / total drafts.
    min_gain: drafts whose marginal expected tokens m_{i,j} fall below it are never taken (rows
        are non-increasing, so this only lowers caps; with 0 the result is the exact optimum).
    """
    a = np.asarray(accept_probs, dtype=np.float64)
    b, kmax = a.shape
    caps = np.clip(np.asarray(caps, dtype=np.int64), 0, kmax)
    marg = np.cumprod(a, axis=1)
    valid = np.arange(kmax)[None, :] < caps[:, None]
    if min_gain > 0:
        valid &= marg >= min_gain
    rows = np.nonzero(valid)[0]
    gains = marg[valid]          # row-major: lower position first per row
    order = np.argsort(-gains, kind="stable")     # stable: ties keep lower position first
    num = b + np.concatenate(([0.0], np.cumsum(gains[order])))
    d = np.arange(len(num), dtype=np.int64)
    den = np.asarray(cost(base_tokens + b + d), dtype=np.float64)
    if drafter_cost is not None:
        den = den + np.asarray(drafter_cost(d), dtype=np.float64)
    if np.any(den <= 0):
        raise ValueError("step cost must be > 0 for every token count")
    best = int(np.argmax(num / den))              # first maximum: the smallest D
    k = np.bincount(rows[order[:best]], minlength=b)
    return k, float(num[best]), float(den[best])


class AdaptiveSpecController:
    """Chooses drafts per request per step; learns acceptance online. Not thread-safe.

    max_k: upper bound on drafts per request (``SpeculativeConfig.max_spec_tokens``).
    prior_alpha / prior_beta: engine-wide Beta prior of per-position acceptance (pseudo-counts).
    prior_strength: pseudo-trials of the engine-wide figure in each request's prior.
    decay / global_decay: evidence discount per verify (request) / per step (engine-wide).
    cost_model: target step cost c(T); default a roofline guess (flat to 128 tokens, then
        linear) — measure one with ``measure_step_costs`` instead.
    drafter_cost: drafter seconds per draft token (float) or a ``StepCostModel`` over D.
    probe_interval: steps without a drafted verify before a request may be probed (0 = never).
    min_draft_gain: a draft expected to add fewer tokens than this is never proposed (covers
        proposer and bookkeeping overheads the cost model does not see; keeps k = 0 at
        acceptance ~0 even where the step cost is flat).
    """

    def __init__(self, max_k: int, *, prior_alpha: float = 1.0, prior_beta: float = 1.0,
                 prior_strength: float = 2.0, decay: float = 0.95, global_decay: float = 0.99,
                 cost_model: StepCostModel | None = None,
                 drafter_cost: float | StepCostModel = 0.0, probe_interval: int = 16,
                 min_draft_gain: float = 0.01) -> None:
        if probe_interval < 0:
            raise ValueError(f"probe_interval must be >= 0, got {probe_interval}")
        if isinstance(drafter_cost, (int, float)) and drafter_cost < 0:
            raise ValueError(f"drafter_cost must be >= 0, got {drafter_cost}")
        self.max_k = int(max_k)
        self.acceptance = AcceptanceEstimator(
            max_k, prior_alpha=prior_alpha, prior_beta=prior_beta,
            prior_strength=prior_strength, decay=decay, global_decay=global_decay)
        self.cost_model = cost_model if cost_model is not None else StepCostModel.linear(
            1.0, 1.0 / 128, knee_tokens=128)
        self.drafter_cost = drafter_cost
        self.probe_interval = int(probe_interval)
        self.min_draft_gain = float(min_draft_gain)
        self.step = 0
        self.k_histogram: dict[int, int] = {}
        self.num_probes = 0
        self.last_plan: Plan | None = None

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> AdaptiveSpecController:
        """From a ``SpeculativeConfig``: max_k = ``config.max_spec_tokens``."""
        return cls(config.max_spec_tokens, **kwargs)

    # ---- costs ----
    def _drafter_fn(self) -> CostFn | None:
        """d(D): None for a free drafter, else seconds for D draft tokens (d(0) = 0)."""
        dc = self.drafter_cost
        if isinstance(dc, (int, float)):
            return None if dc == 0 else (lambda d: dc * np.asarray(d, dtype=np.float64))
        return lambda d: np.where(np.asarray(d) > 0, dc.cost(np.maximum(d, 1)), 0.0)

    def _target_cost(self, num_requests: int) -> CostFn:
        """c(T) for a step of ``num_requests`` requests (the per-request term is a constant)."""
        model = self.cost_model
        if num_requests <= 1 or not getattr(model, "per_request", 0.0):
            return model.cost
        return lambda t: model.cost(t, num_requests)

    def _step_cost(self, base: int, b: int, num_requests: int | None = None) -> CostFn:
        """Denominator of R as a function of the total drafts D."""
        drafter = self._drafter_fn()
        target = self._target_cost(b if num_requests is None else num_requests)

        def total(d: np.ndarray) -> np.ndarray:
            c = target(base + b + np.asarray(d))
            return c if drafter is None else c + drafter(d)
        return total

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
        return np.clip(out, 0, self.max_k)

    def choose(self, requests: Sequence[Request], base_tokens: int = 0,
               caps: Sequence[int] | None = None, base_requests: int = 0) -> list[int]:
        """Drafts to propose for each request next step (``0 <= k_i <= cap_i``).

        base_tokens: tokens the step carries besides each listed request's 1 + k_i (prefill
        chunks, non-speculating requests). base_requests: how many requests those are (for
        the cost model's per-request term). Call once per engine step.
        """
        if base_tokens < 0:
            raise ValueError(f"base_tokens must be >= 0, got {base_tokens}")
        if base_requests < 0:
            raise ValueError(f"base_requests must be >= 0, got {base_requests}")
        self.step += 1
        self.acceptance.decay_global()
        b = len(requests)
        if b == 0:
            self.last_plan = Plan([], 0.0, 0.0, 0.0)
            return []
        cap = self.caps_for(requests, caps)
        slots = self.acceptance.slots([r.request_id for r in requests], self.step)
        probs = self.acceptance.probs(slots)
        n_req = b + int(base_requests)
        k, num, _ = optimal_draft_lengths(probs, cap, base_tokens, self._target_cost(n_req),
                                          self._drafter_fn(), self.min_draft_gain)
        cost = self._step_cost(base_tokens, b, n_req)
        n_probes = self._add_probes(k, cap, slots, num, cost)
        num += n_probes * float(self.acceptance.global_probs()[0])
        den = float(cost(int(k.sum())))
        self.last_plan = Plan(k.tolist(), num, den, num / den, n_probes)
        hist = self.k_histogram
        for kv, cnt in zip(*np.unique(k, return_counts=True)):
            hist[int(kv)] = hist.get(int(kv), 0) + int(cnt)
        return self.last_plan.k

    def _add_probes(self, k: np.ndarray, cap: np.ndarray, slots: np.ndarray, num: float,
                    cost: CostFn) -> int:
        """Give k=1 to the overdue idle requests worth probing (modifies ``k``); count them."""
        if self.probe_interval == 0:
            return 0
        idle = self.step - self.acceptance.last_drafted_step[slots]
        cand = np.flatnonzero((k == 0) & (cap >= 1) & (idle >= self.probe_interval))
        if len(cand) == 0:
            return 0
        g = float(self.acceptance.global_probs()[0])
        if g < self.min_draft_gain:
            return 0
        d0 = int(k.sum())
        m = np.arange(len(cand) + 1)
        ratio = (num + g * m) / cost(d0 + m)
        n = int(np.argmax(ratio))
        if n:
            chosen = cand[np.argsort(-idle[cand], kind="stable")[:n]]
            k[chosen] = 1
            self.num_probes += n
        return n

    # ---- transactions ----
    def snapshot(self) -> tuple:
        """Everything ``choose`` changes, so a failed engine step can put it back."""
        return (self.step, self.acceptance.snapshot(), dict(self.k_histogram), self.num_probes, self.last_plan)

    def restore(self, saved: tuple) -> None:
        self.step, acceptance, self.k_histogram, self.num_probes, self.last_plan = saved
        self.acceptance.restore(acceptance)

    # ---- feedback ----
    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """After ``update_from_output``: the request verified ``num_draft``, kept
        ``num_accepted``."""
        self.acceptance.observe(request_id, num_draft, num_accepted, self.step)

    def observe_step(self, total_tokens: int, seconds: float,
                     num_requests: int | None = None) -> None:
        """The runner's measured step: ``total_tokens`` tokens of ``num_requests`` requests (if
        known) took ``seconds``."""
        if num_requests is None:
            self.cost_model.update(total_tokens, seconds)
        else:
            self.cost_model.update(total_tokens, seconds, num_requests=num_requests)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted; free its state."""
        self.acceptance.forget(request_id)

    def estimate(self, request_id: str) -> list[float]:
        """Current per-position conditional acceptance estimate of ``request_id``."""
        return self.acceptance.estimate(request_id)
