"""The draft lengths that maximise a step's expected committed tokens per second: exact.

Objective. For drafts k = (k_1..k_B) over the B decoding requests of the next step,

    maximise  R(k) = sum_i E_i(k_i) / C(k)

with E_i(k) = 1 + sum_{j<k} m_{i,j},  m_{i,j} = prod_{l<=j} a_{i,l}  (expected committed tokens:
accepted drafts plus the bonus/recovered token), a_{i,l} the per-request conditional acceptance
estimates (``spec.acceptance``) and C(k) the cost of the whole step carrying those drafts as the
engine measures it (``spec.cost_model``: learned online from this engine's own steps, seeded by a
start-up probe; no cost constant is set by hand). In that model a draft j of request i adds one
row and one logit row (a cost g(D) that depends only on the step's total drafts D, convex in D)
plus its attention over the request's context (c_{i,j} = w_attention * keys, per request: a
verify row of a long-context request costs more than one of a short chat) and, for a model
drafter, the drafting (w_draft_row per draft, and w_draft_request on a request's first draft:
the head's catch-up and dispatch, paid once per drafted request). So

    C(k) = g(D) + sum_{i, j < k_i} c_{i,j}.

Exact algorithm (``optimal_draft_lengths``, Dinkelbach's method for a ratio): R* is the largest
lambda with F(lambda) = max_k [N(k) - lambda C(k)] >= 0. For a fixed lambda, each candidate draft
has value v_{i,j} = m_{i,j} - lambda c_{i,j}; within a row v is non-increasing in j (m falls, c
grows with the keys), so for any D the D largest values, ties to the lower position, form a union
of prefixes (a valid k), and no other D drafts have a larger sum; scanning D over the sorted prefix
sums with - lambda g(D) gives F(lambda) exactly. Start at lambda = R(0) (no drafts), set lambda to
the ratio of the maximiser and repeat: each round strictly raises R until F(lambda) = 0, which is
the global optimum (finite: there are finitely many k). Ties pick the smallest D (less
speculation). A model drafter's per-request cost makes a row's first draft dearer than its
second, so v may rise along a row; such rows are ironed first (pool adjacent violators: v replaced
by the slopes of its concave majorant, equal within a pooled block, so the sorted order still
takes prefixes), and the D scan sums the true values. That is exact when g is linear (each row's
best k is a block boundary where the ironed values change sign, and the prefix of all positive
blocks is among those scanned) and a close approximation when g bends (a test bounds it).
Cost: a few sorts of <= B*K numbers (figures: benches/RESULTS.md, "Figures behind decisions in
the source").

Used by the controller (``spec.adaptive``) every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate


def optimal_draft_lengths(accept_probs: Sequence[Sequence[float]], caps: Sequence[int],
                          step_costs: Sequence[float],
                          row_costs: Sequence[Sequence[float]] | None = None, max_rounds: int = 64
                          ) -> tuple[list[int], float, float]:
    """Exact maximiser of R(k) (module docstring). Returns (k, numerator, denominator).

    accept_probs: per request, conditional acceptance probabilities a_{i,j} in [0, 1].
    caps: per request, an upper bound on k_i (clipped to [0, len(accept_probs[i])]).
    step_costs: g(D) for D = 0 .. sum of the caps (> 0).
    row_costs: per request, c_{i,j} >= 0 for j < cap_i (None: all 0); exact when each row is
        non-decreasing in j or g is linear (module docstring).

    Plain Python: the candidates are at most B * max_k numbers and this runs every step (see
    ``spec.acceptance`` on why not numpy).
    """
    b = len(caps)
    gains: list[float] = []   # row-major: lower position first per row
    costs: list[float] = []
    owner: list[int] = []
    bumpy: list[range] = []   # candidate spans of the rows whose cost falls somewhere (ironed)
    for i, (row, cap) in enumerate(zip(accept_probs, caps)):
        rc = None if row_costs is None else row_costs[i]
        m = 1.0
        start = len(gains)
        for j in range(max(0, min(int(cap), len(row)))):
            m *= float(row[j])
            gains.append(m)
            costs.append(0.0 if rc is None else float(rc[j]))
            owner.append(i)
        if any(costs[j + 1] < costs[j] for j in range(start, len(gains) - 1)):
            bumpy.append(range(start, len(gains)))
    n = len(gains)
    g = [float(x) for x in step_costs[:n + 1]]
    if len(g) < n + 1:
        raise ValueError(f"step_costs has {len(g)} entries, need {n + 1}")
    if min(g) <= 0 or (costs and min(costs) < 0):
        raise ValueError("step cost must be > 0 and draft costs >= 0")
    sel: list[int] = []
    num, den = float(b), g[0]
    for _ in range(max_rounds if n else 0):
        lam = num / den
        v = [x - lam * c for x, c in zip(gains, costs)]
        key = _ironed(v, bumpy) if bumpy else v
        order = sorted(range(n), key=key.__getitem__, reverse=True)  # stable: ties keep the lower position
        f = [-lam * g[0]] + [a - lam * gt for a, gt in zip(accumulate([v[o] for o in order]), g[1:])]
        d = max(range(n + 1), key=f.__getitem__)      # the first maximum: the smallest D
        cand = order[:d]
        cnum = b + sum(gains[o] for o in cand)
        cden = g[d] + sum(costs[o] for o in cand)
        if cnum / cden <= lam * (1.0 + 1e-12):
            break
        sel, num, den = cand, cnum, cden
    k = [0] * b
    for o in sel:
        k[owner[o]] += 1
    return k, num, den


def _ironed(v: list[float], spans: list[range]) -> list[float]:
    """``v`` with each span replaced by the slopes of its cumulative sum's concave majorant (pool
    adjacent violators): non-increasing along the span, equal within a pooled block, and the
    same total over each block."""
    out = list(v)
    for span in spans:
        blocks: list[list[float]] = []   # [sum, count]
        for j in span:
            blocks.append([v[j], 1.0])
            while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] < blocks[-1][0] * blocks[-2][1]:
                s, c = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += c
        j = span.start
        for s, c in blocks:
            for _ in range(int(c)):
                out[j] = s / c
                j += 1
    return out
