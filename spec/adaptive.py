"""Speculation-length controller: per step, drafts per request that maximise tokens per second.

Objective and optimiser: ``spec.draft_lengths`` (``optimal_draft_lengths``, exact, given the
per-request acceptance a_{i,j} from ``spec.acceptance`` and the step cost from
``spec.cost_model``). This module feeds it every step and learns both online.

Holding k = 0. When a plan gives k = 0 to every request, the next steps repeat it without
solving again while nothing it depends on has moved: the same requests with the same draft kinds,
caps no larger (fewer candidates cannot raise the optimum), the same ``base``, no new verdict
(``observe``) and no refit of the cost model, for at most ``HOLD_STEPS`` steps. What still moves
inside a hold is slow (the engine-wide estimates decaying toward the prior) or only makes drafts
dearer (contexts growing), so a request resumes drafting at most ``HOLD_STEPS`` steps late.
The point is the steps where speculation is off — open chat with a model drafter at batch 1,
where a full solve every ~5 ms step cost ~3 % (benches/RESULTS.md, "Controller overhead").

What falls out: k = 0 for requests whose drafts do not pay (low m or long context); shorter k
as the batch grows (a draft must return more than the step's average cost per token, which
falls with B); k = 0 for everyone when no draft raises R (a compute-bound step where a verify row
costs more than it returns).

Sleeping. Most steps of open chat draft nothing, and deciding so still costs: the proposer
drafts at the cap for every request, then the choice (~100 us a step at batch 4, ~1.5 % of a
7.5 ms step on the C kernels, benches/RESULTS.md). After Z steps in a row on which there were
drafts and none paid (k = 0 for everyone but probes; a step with no draft at all, no n-gram match
anywhere, neither counts nor breaks the run: it is cheap already, and in math or code at batch 1
the match that ends it is the draft that pays), the next min(Z // ``SLEEP_RAMP``, ``MAX_SLEEP``)
steps skip both (``asleep``):
a short run sleeps nothing, a long one 3 steps in 4, and a request resumes drafting at most
``MAX_SLEEP`` steps late. Sleeping s steps in s + 1 saves s / (s + 1) of the cost and delays
the way back by up to s steps: 3 keeps 3/4 of the saving of 7 in 8 at under half the delay
(open chat at B = 4: decode 0.982x plain awake, 0.999x with 3, 1.003x with 7; code edits at
B = 1 within noise of awake). A request that was not in the last zero plan (a new one decoding)
wakes the controller at once, so it is judged on its own drafts.

Staleness and probing. A request at k = 0 produces no evidence, so its low estimate would
stick. Two mechanisms let drafting resume: (1) evidence decays (``spec.acceptance``); (2) probing:
a request that has had no drafted verify for ``probe_interval`` steps (and whose cap allows
drafts) is a probe candidate; probes are one draft each, valued at the engine-wide first-position
rate p_0, and the controller adds the number of probes (most overdue first) that maximises R given
the chosen plan — so probes are spent only where speculation could pay at the current batch size
and cost. ``probe_interval=0`` disables probing. A probe whose draft is rejected doubles that
request's wait before the next one (up to ``MAX_PROBE_BACKOFF`` intervals) and an accepted one
resets it: where nothing pays (open chat, where n-gram matches are common and their drafts
rarely accepted) a request stops paying a verify row every ``probe_interval`` steps, while a
request whose text starts repeating is still found within a few dozen steps.

Draft kinds. A drafter may label each request's draft (``spec.proposer``: n-gram, the length of
the matched suffix; suffix decoding, the match length's class; EAGLE-3 with suffix decoding, the
head's drafts apart from the copied ones). The controller keeps one ``AcceptanceEstimator`` per
kind, engine-wide prior included, and a request's a_{i,j} this step are those of its row in the
estimator of its draft's kind: on code edits an n-gram draft after a 4-token match was accepted
at the first position 89 % of the time and one after a 2-token match 47 % (benches/RESULTS.md,
"Acceptance by draft kind"), so one estimate per request would average a sure draft with a
coin flip and price both wrong.

Per-request control: ``Request.max_spec_tokens`` (None = engine default ``max_k``, 0 = never)
caps k_i; ``choose(..., caps=...)`` takes further caps (``scheduler.drafts.draft_limit``, or the
length of the drafts a free drafter actually found) so the plan counts no clipped drafts.

Engine integration (``spec.speculator`` is the glue): ``asleep``, then (awake) ``choose`` before
the step with the step's other work as ``base`` (a ``StepShape``), ``observe`` per verified request and ``observe_step``
with the step's shape and measured seconds after the commit, ``forget`` when a request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from tokenbudget.scheduler.request import Request
from tokenbudget.spec.acceptance import AcceptanceEstimator, Evidence
from tokenbudget.spec.cost_model import StepCostModel, StepShape
from tokenbudget.spec.draft_lengths import optimal_draft_lengths

_EMPTY = StepShape(0, 0, 0, 0.0)
HOLD_STEPS = 8  # longest run of steps an all-zero plan is repeated without solving (module docstring)
SLEEP_RAMP = 8  # steps of k = 0 for everyone per step of sleep (module docstring, "Sleeping")
MAX_SLEEP = 3   # most steps slept in a row (module docstring, "Sleeping")
MAX_PROBE_BACKOFF = 8  # most probe intervals a request waits after rejected probes (module docstring)


@dataclass(slots=True)
class Plan:
    """The last ``choose`` result: per-request k, expected committed tokens, step cost, ratio."""

    k: list[int]
    expected_tokens: float
    cost: float
    ratio: float
    num_probes: int = 0


class AdaptiveSpecController:
    """Chooses drafts per request per step; learns acceptance and step cost online. Not
    thread-safe.

    max_k: upper bound on drafts per request (``SpeculativeConfig.max_spec_tokens``).
    cost_model: this engine's ``StepCostModel`` (``engine.drafters.step_cost`` measures the prior).
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
        self._estimator_args = dict(prior_alpha=prior_alpha, prior_beta=prior_beta,
                                    prior_strength=prior_strength, decay=decay, global_decay=global_decay)
        self.acceptance = AcceptanceEstimator(max_k, **self._estimator_args)
        # One estimator per draft kind (``spec.proposer``), each with its own engine-wide prior;
        # kind None (drafters without kinds) is ``acceptance``.
        self._by_kind: dict[Hashable, AcceptanceEstimator] = {None: self.acceptance}
        self.cost_model = cost_model
        self.probe_interval = int(probe_interval)
        self.step = 0
        self.k_histogram: dict[int, int] = {}
        self.num_probes = 0
        self.num_slept = 0   # steps slept through (``asleep``)
        self.last_plan: Plan | None = None
        self._num_verdicts = 0               # observe() calls: any verdict can move an estimate
        self._hold: tuple | None = None      # (inputs, caps, step) of the last all-zero plan solved
        self._probed: frozenset[str] = frozenset()   # the requests the last plan probes
        self._zero_streak = 0                        # steps in a row with k = 0 for everyone
        self._sleep = 0                              # steps still to sleep (``asleep``)
        self._sleep_ids: frozenset[str] = frozenset()   # the requests of the last zero plan

    @classmethod
    def from_config(cls, config: Any, cost_model: StepCostModel, **kwargs: Any
                    ) -> AdaptiveSpecController:
        """From a ``SpeculativeConfig``: max_k = ``config.max_spec_tokens``."""
        return cls(config.max_spec_tokens, cost_model, **kwargs)

    # ---- the per-step decision ----
    def caps_for(self, requests: Sequence[Request], caps: Sequence[int] | None = None) -> list[int]:
        """min(max_k, Request.max_spec_tokens, caps[i]) per request, >= 0."""
        kmax = self.max_k
        out = [kmax if r.max_spec_tokens is None else min(kmax, r.max_spec_tokens) for r in requests]
        if caps is not None:
            if len(caps) != len(requests):
                raise ValueError(f"caps has {len(caps)} entries for {len(requests)} requests")
            out = [min(a, int(c)) for a, c in zip(out, caps)]
        return [a if a > 0 else 0 for a in out]

    def step_costs(self, requests: Sequence[Request], base: StepShape = _EMPTY,
                   max_drafts: int | None = None, model_drafted: Sequence[bool] | None = None
                   ) -> tuple[list[float], list[list[float]]]:
        """g(D) for D = 0..max_drafts (default B * max_k) and c_{i,j} for j < max_k, for these
        decoding requests on top of ``base`` (``spec.draft_lengths``).

        Request i decodes one row after ``num_computed_tokens`` cached tokens; its draft j is the
        row after that and attends ``context + j + 2`` keys. ``model_drafted[i]``: its drafts would
        come from a model drafter, whose cost is added (``StepCostModel.drafter_weights``: per
        request on the first draft, per row on every draft)."""
        ctx = [r.num_computed_tokens for r in requests]
        b = len(requests)
        model = self.cost_model
        g = model.token_curve(self._zero_shape(requests, base), b * self.max_k if max_drafts is None else max_drafts)
        w = model.attention_weight / 1000.0
        span = range(2, self.max_k + 2)
        rows = [[w * (c + j) for j in span] for c in ctx]
        if model_drafted is not None and any(model_drafted):
            per_request, per_row = model.drafter_weights
            for row, drafted in zip(rows, model_drafted):
                if drafted:
                    row[:] = [x + per_row for x in row]
                    row[0] += per_request
        return g, rows

    @staticmethod
    def _zero_shape(requests: Sequence[Request], base: StepShape) -> StepShape:
        """The step without drafts: ``base`` and one decode row per request."""
        b = len(requests)
        decode_keys = (sum(r.num_computed_tokens for r in requests) + b) / 1000.0  # request_attention(ctx, 1) each
        return StepShape(base.requests + b, base.tokens + b, base.logit_rows + b, base.attention + decode_keys)

    def estimator(self, kind: Hashable = None) -> AcceptanceEstimator:
        """The acceptance estimator of drafts of ``kind`` (created at the prior on first use)."""
        est = self._by_kind.get(kind)
        if est is None:
            est = self._by_kind[kind] = AcceptanceEstimator(self.max_k, **self._estimator_args)
        return est

    def choose(self, requests: Sequence[Request], base: StepShape | None = None,
               caps: Sequence[int] | None = None, kinds: Sequence[Hashable] | None = None,
               model_drafted: Sequence[bool] | None = None) -> list[int]:
        """Drafts to propose for each request next step (``0 <= k_i <= cap_i``).

        base: what the step carries besides the listed requests' 1 + k_i rows (prefill chunks,
        non-speculating requests). kinds: per request, the kind of the draft it would verify
        (``spec.proposer``; None: one kind for all). model_drafted: per request, whether a model
        drafter would draft it (its cost is then priced, ``step_costs``; None: no one). Call once
        per engine step.
        """
        base = _EMPTY if base is None else base
        if base.tokens < 0 or base.requests < 0 or base.logit_rows < 0 or base.attention < 0:
            raise ValueError(f"base must have no negative field, got {base}")
        if kinds is not None and len(kinds) != len(requests):
            raise ValueError(f"kinds has {len(kinds)} entries for {len(requests)} requests")
        self._next_step()
        cap = self.caps_for(requests, caps)
        k = self._plan(requests, base, cap, kinds, model_drafted)
        if sum(k) > self.last_plan.num_probes:   # drafts that pay (a probe alone does not wake)
            self._zero_streak = self._sleep = 0
        elif any(cap):                           # there were drafts, and none paid
            self._zero_streak += 1
            self._sleep = min(self._zero_streak // SLEEP_RAMP, MAX_SLEEP)
            self._sleep_ids = frozenset(r.request_id for r in requests)
        return k

    def asleep(self, requests: Sequence[Request]) -> bool:
        """Whether this step skips drafting and choosing altogether (module docstring,
        "Sleeping"); if so, it counts as a step with k = 0 for these requests. Call instead of
        ``choose``, before drafting."""
        if not self._sleep or not self._sleep_ids.issuperset(r.request_id for r in requests):
            self._sleep = 0
            return False
        self._sleep -= 1
        self._zero_streak += 1
        self.num_slept += 1
        self._next_step()
        self._no_drafts(len(requests), self.last_plan.cost, self.last_plan.ratio)
        return True

    def _next_step(self) -> None:
        self.step += 1
        self._probed = frozenset()
        for est in self._by_kind.values():
            est.decay_global()

    def _plan(self, requests: Sequence[Request], base: StepShape, cap: list[int],
              kinds: Sequence[Hashable] | None, model_drafted: Sequence[bool] | None) -> list[int]:
        """``choose``'s plan: k = 0 where nothing can be drafted, the held zero plan, or the solve."""
        b = len(requests)
        if not any(cap):   # nothing to draft (no n-gram match, every request capped at 0): no choice
            return self._no_drafts(b, 0.0, 0.0)
        inputs = (tuple(r.request_id for r in requests), None if kinds is None else tuple(kinds),
                  None if model_drafted is None else tuple(model_drafted), base, self._num_verdicts,
                  self.cost_model.version)
        hold = self._hold
        if (hold is not None and hold[0] == inputs and self.step - hold[2] < HOLD_STEPS
                and all(c <= h for c, h in zip(cap, hold[1]))):
            return self._no_drafts(b, self.last_plan.cost, self.last_plan.ratio)
        ests, rows = self._evidence(requests, kinds)
        costs = cache(lambda: self.step_costs(requests, base, sum(cap), model_drafted))  # once, if asked
        g0 = None if model_drafted is not None and any(model_drafted) else self._no_draft_cost(
            requests, base, cap, ests, rows)
        if g0 is not None:      # no first draft pays, so no draft does: k = 0 without solving
            k, num, den = [0] * b, float(b), g0
        else:
            g, row_costs = costs()
            k, num, den = optimal_draft_lengths(self._probs(ests, rows), cap, g, row_costs)
        probed, num, den = self._add_probes(k, cap, ests, rows, num, den, costs)
        self._probed = frozenset(requests[i].request_id for i in probed)
        self.last_plan = Plan(k, num, den, num / den, len(probed))
        self._hold = None if any(k) else (inputs, cap, self.step)
        hist = self.k_histogram
        for kv in k:
            hist[kv] = hist.get(kv, 0) + 1
        return k

    def _no_drafts(self, b: int, cost: float, ratio: float) -> list[int]:
        """A plan of k = 0 for all ``b`` requests, without solving."""
        self.last_plan = Plan([0] * b, float(b), cost, ratio)
        if b:
            self.k_histogram[0] = self.k_histogram.get(0, 0) + b
        return self.last_plan.k

    def _evidence(self, requests: Sequence[Request], kinds: Sequence[Hashable] | None
                  ) -> tuple[list[AcceptanceEstimator], list[Evidence]]:
        """Per request: the estimator of its draft's kind and its evidence there."""
        step = self.step
        if kinds is None:
            est = self.acceptance
            return [est] * len(requests), est.rows([r.request_id for r in requests], step)
        ests = [self.estimator(kd) for kd in kinds]
        return ests, [est.row(r.request_id, step) for est, r in zip(ests, requests)]

    @staticmethod
    def _probs(ests: list[AcceptanceEstimator], rows: list[Evidence]) -> list[list[float]]:
        """a_{i,j} per request, one ``probs`` call per estimator."""
        groups: dict[int, list[int]] = {}
        for i, est in enumerate(ests):
            groups.setdefault(id(est), []).append(i)
        out: list = [None] * len(rows)
        for idx in groups.values():
            for i, p in zip(idx, ests[idx[0]].probs([rows[i] for i in idx])):
                out[i] = p
        return out

    def _no_draft_cost(self, requests: Sequence[Request], base: StepShape, cap: list[int],
                       ests: list[AcceptanceEstimator], rows: list[Evidence]) -> float | None:
        """g(0), the cost of the step without drafts, if no request's first draft returns more
        tokens per second than that step (a_{i,0} <= R_0 (g(1) - g(0) + c_{i,0}), R_0 = B / g(0));
        None if one does, or if g is not convex. Then no set of drafts pays either: along a row
        acceptance products fall and (free drafters) row costs rise, g's increments rise, so every
        draft in a set returns at most R_0 times the increment it can be charged. This is most
        steps of open chat (n-gram matches common, rarely paying): the test costs a few operations
        per request, the solve ~4x that (~57 us a step at batch 4)."""
        b, zero = len(requests), self._zero_shape(requests, base)
        if not self.cost_model.is_convex_above(zero.tokens):
            return None
        g = self.cost_model.token_curve(zero, 1)
        r0, dg, w = b / g[0], g[1] - g[0], self.cost_model.attention_weight / 1000.0
        first = {}
        for est, e, c, r in zip(ests, rows, cap, requests):
            if c:
                p0 = first.get(id(est))
                if p0 is None:
                    p0 = first[id(est)] = est.prior_strength * est.global_probs()[0]
                s = est.prior_strength
                if (p0 + e.succ[0]) / (s + e.trials[0]) > r0 * (dg + w * (r.num_computed_tokens + 2)):
                    return None
        return g[0]

    def _add_probes(self, k: list[int], cap: list[int], ests: list[AcceptanceEstimator],
                    rows: list[Evidence], num: float, den: float,
                    costs: Callable[[], tuple[list[float], list[list[float]]]]
                    ) -> tuple[list[int], float, float]:
        """Give k=1 to the overdue idle requests worth probing (modifies ``k``); returns their
        indices and the plan's new numerator and denominator. Overdue: ``probe_interval`` steps
        times the request's backoff since its last drafted verify. ``costs``: g and c_{i,j}
        (``step_costs``), asked for only if some request is overdue."""
        if self.probe_interval == 0:
            return [], num, den
        step, interval = self.step, self.probe_interval
        idle = [(step - e.last_drafted_step, i) for i, e in enumerate(rows)
                if k[i] == 0 and cap[i] >= 1 and step - e.last_drafted_step >= interval * e.probe_backoff]
        if not idle:
            return [], num, den
        g, row_costs = costs()
        idle.sort(key=lambda t: -t[0])               # most overdue first (stable)
        d0 = sum(k)
        lin = den - g[d0]
        best, n, best_den, hope, extra = num / den, 0, den, 0.0, 0.0
        for m, (_, i) in enumerate(idle, 1):
            hope += ests[i].first_position_upper()   # decide optimistically, report the mean
            extra += row_costs[i][0]
            cost = g[d0 + m] + lin + extra
            if (num + hope) / cost > best:
                best, n, best_den = (num + hope) / cost, m, cost
        probed = [i for _, i in idle[:n]]
        for i in probed:
            k[i] = 1
        self.num_probes += n
        return probed, num + sum(ests[i].global_probs()[0] for i in probed), best_den

    # ---- transactions ----
    def snapshot(self) -> tuple:
        """Everything ``choose`` changes, so a failed engine step can put it back."""
        return (self.step, {kd: est.snapshot() for kd, est in self._by_kind.items()},
                dict(self.k_histogram), self.num_probes, self.num_slept, self.last_plan, self._hold,
                self._probed, self._zero_streak, self._sleep, self._sleep_ids)

    def restore(self, saved: tuple) -> None:
        (self.step, estimators, self.k_histogram, self.num_probes, self.num_slept, self.last_plan, self._hold,
         self._probed, self._zero_streak, self._sleep, self._sleep_ids) = saved
        self._by_kind = {kd: est for kd, est in self._by_kind.items() if kd in estimators}
        for kd, est in self._by_kind.items():
            est.restore(estimators[kd])

    # ---- feedback ----
    def observe(self, request_id: str, num_draft: int, num_accepted: int, kind: Hashable = None) -> None:
        """After the commit: the request verified ``num_draft`` drafts of ``kind``, kept
        ``num_accepted`` (a probe's verdict also sets its backoff, module docstring)."""
        est = self.estimator(kind)
        est.observe(request_id, num_draft, num_accepted, self.step)
        self._num_verdicts += 1
        if request_id in self._probed and num_draft:
            e = est.row(request_id, self.step)
            e.probe_backoff = 1 if num_accepted else min(2 * e.probe_backoff, MAX_PROBE_BACKOFF)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """The engine's measured step: it carried ``shape`` and took ``seconds``."""
        self.cost_model.update(shape, seconds)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted; free its state (every kind's)."""
        for est in self._by_kind.values():
            est.forget(request_id)

    def estimate(self, request_id: str, kind: Hashable = None) -> list[float]:
        """Current per-position conditional acceptance estimate of ``request_id``'s drafts of
        ``kind``."""
        return self.estimator(kind).estimate(request_id)

    @property
    def kinds(self) -> list[Hashable]:
        """The draft kinds seen so far (None first: drafters without kinds)."""
        return list(self._by_kind)

    def tracked_requests(self) -> set[str]:
        """Request ids with evidence in any kind (tests: released on the one release path)."""
        return {rid for est in self._by_kind.values() for rid in est}
