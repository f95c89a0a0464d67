"""What a step's drafts cost and return, as the draft-length controller prices them.

``step_costs`` turns the step cost model (``spec.cost_model``) into the optimiser's inputs
(``spec.draft_lengths``): g(D), the step's cost with D drafts in all, and c_{i,j}, what draft j of
request i adds on its own (its attention, and a model drafter's work). ``no_draft_cost`` is the
cheap test that lets most steps of open chat skip the optimiser: when no request's first draft
pays, no set of drafts does. ``add_probes`` prices probes (one draft for an idle request, valued
optimistically) on top of a plan. ``probs_by_estimator`` reads each request's acceptance from the
estimator of its draft's kind (``spec.acceptance``). Pure functions of their arguments: the
controller (``spec.adaptive``) holds the state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenbudget.scheduler.request import Request
from tokenbudget.spec.acceptance import AcceptanceEstimator, Evidence
from tokenbudget.spec.cost_model import StepCostModel
from tokenbudget.spec.step_shape import StepShape


def zero_shape(requests: Sequence[Request], base: StepShape) -> StepShape:
    """The step without drafts: ``base`` and one decode row per request."""
    b = len(requests)
    decode_keys = (sum(r.num_computed_tokens for r in requests) + b) / 1000.0  # request_attention(ctx, 1) each
    return StepShape(base.requests + b, base.tokens + b, base.logit_rows + b, base.attention + decode_keys)


def step_costs(model: StepCostModel, max_k: int, requests: Sequence[Request], base: StepShape,
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
    g = model.token_curve(zero_shape(requests, base), b * max_k if max_drafts is None else max_drafts)
    w = model.attention_weight / 1000.0
    span = range(2, max_k + 2)
    rows = [[w * (c + j) for j in span] for c in ctx]
    if model_drafted is not None and any(model_drafted):
        per_request, per_row = model.drafter_weights
        for row, drafted in zip(rows, model_drafted):
            if drafted:
                row[:] = [x + per_row for x in row]
                row[0] += per_request
    return g, rows


def probs_by_estimator(ests: list[AcceptanceEstimator], rows: list[Evidence]) -> list[list[float]]:
    """a_{i,j} per request, one ``probs`` call per estimator."""
    groups: dict[int, list[int]] = {}
    for i, est in enumerate(ests):
        groups.setdefault(id(est), []).append(i)
    out: list = [None] * len(rows)
    for idx in groups.values():
        for i, p in zip(idx, ests[idx[0]].probs([rows[i] for i in idx])):
            out[i] = p
    return out


def no_draft_cost(model: StepCostModel, requests: Sequence[Request], base: StepShape, cap: list[int],
                  ests: list[AcceptanceEstimator], rows: list[Evidence]) -> float | None:
    """g(0), the cost of the step without drafts, if no request's first draft returns more
    tokens per second than that step (a_{i,0} <= R_0 (g(1) - g(0) + c_{i,0}), R_0 = B / g(0));
    None if one does, or if g is not convex. Then no set of drafts pays either: along a row
    acceptance products fall and (free drafters) row costs rise, g's increments rise, so every
    draft in a set returns at most R_0 times the increment it can be charged. This is most
    steps of open chat (n-gram matches common, rarely paying): the test costs a few operations
    per request, a fraction of the solve (benches/RESULTS.md, "Figures behind decisions in the
    source")."""
    b, zero = len(requests), zero_shape(requests, base)
    if not model.is_convex_above(zero.tokens):
        return None
    g = model.token_curve(zero, 1)
    r0, dg, w = b / g[0], g[1] - g[0], model.attention_weight / 1000.0
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


def add_probes(k: list[int], cap: list[int], ests: list[AcceptanceEstimator], rows: list[Evidence], num: float,
               den: float, costs: Callable[[], tuple[list[float], list[list[float]]]], step: int, interval: int
               ) -> tuple[list[int], float, float]:
    """Give k=1 to the overdue idle requests worth probing (modifies ``k``); returns their
    indices and the plan's new numerator and denominator. Overdue: ``interval`` steps (the
    controller's ``probe_interval``; 0: never) times the request's backoff since its last drafted
    verify. ``costs``: g and c_{i,j} (``step_costs``), asked for only if some request is overdue."""
    if interval == 0:
        return [], num, den
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
    return probed, num + sum(ests[i].global_probs()[0] for i in probed), best_den
