"""The exact draft-length optimiser: against brute force, with and without a drafter's per-request
cost."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.spec.draft_lengths import optimal_draft_lengths


def _e(row, k):
    """E(k) = 1 + sum_{j<k} prod_{l<=j} a_l, computed the slow way."""
    return 1.0 + sum(math.prod(row[: j + 1]) for j in range(k))


_prob = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.5, 1.0]))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_optimal_against_brute_force(data):
    b = data.draw(st.integers(1, 4), label="B")
    kmax = data.draw(st.integers(1, 4), label="K")
    probs = [data.draw(st.lists(_prob, min_size=kmax, max_size=kmax)) for _ in range(b)]
    caps = data.draw(st.lists(st.integers(0, kmax), min_size=b, max_size=b))
    n = b * kmax + 1
    steps = data.draw(st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n))
    convex = data.draw(st.booleans())
    if convex:     # what the cost model produces: increasing, convex in D
        incr = sorted(steps)
        curve = list(itertools.accumulate(incr, initial=data.draw(st.floats(0.01, 10.0))))
    else:          # exactness needs neither: any positive table
        curve = [s + 0.01 for s in steps]
    # per-request draft costs, non-decreasing along each row
    rc = np.array([sorted(data.draw(st.lists(st.sampled_from([0.0, 0.1, 0.5, 2.0]),
                                             min_size=kmax, max_size=kmax))) for _ in range(b)])

    def obj(ks):
        return (sum(_e(r, k) for r, k in zip(probs, ks))
                / (curve[sum(ks)] + sum(rc[i, :k].sum() for i, k in enumerate(ks))))
    k, num, den = optimal_draft_lengths(probs, caps, curve, rc.tolist())
    assert all(0 <= ki <= ci for ki, ci in zip(k, caps))
    assert num / den == pytest.approx(obj(list(k)), rel=1e-9)
    best = max(obj(ks) for ks in itertools.product(*(range(c + 1) for c in caps)))
    assert obj(list(k)) == pytest.approx(best, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_optimal_with_a_per_request_drafting_cost(data):
    """A model drafter's per-request cost on the first draft (costs that fall along a row): exact
    when g is linear, within 5 % of the optimum when it bends (module docstring)."""
    b = data.draw(st.integers(1, 4), label="B")
    kmax = data.draw(st.integers(1, 4), label="K")
    probs = [data.draw(st.lists(_prob, min_size=kmax, max_size=kmax)) for _ in range(b)]
    caps = data.draw(st.lists(st.integers(0, kmax), min_size=b, max_size=b))
    setup = data.draw(st.lists(st.sampled_from([0.0, 0.2, 1.0, 3.0]), min_size=b, max_size=b))
    per = [sorted(data.draw(st.lists(st.sampled_from([0.0, 0.1, 0.5]), min_size=kmax, max_size=kmax)))
           for _ in range(b)]
    rc = [[per[i][j] + (setup[i] if j == 0 else 0.0) for j in range(kmax)] for i in range(b)]
    n = b * kmax + 1
    linear = data.draw(st.booleans(), label="linear")
    g0 = data.draw(st.floats(0.01, 5.0))
    if linear:
        slope = data.draw(st.floats(0.0, 2.0))
        curve = [g0 + slope * d for d in range(n)]
    else:
        curve = list(itertools.accumulate(sorted(data.draw(
            st.lists(st.floats(0.0, 3.0), min_size=n - 1, max_size=n - 1))), initial=g0))

    def obj(ks):
        return (sum(_e(r, k) for r, k in zip(probs, ks))
                / (curve[sum(ks)] + sum(sum(rc[i][:k]) for i, k in enumerate(ks))))
    k, num, den = optimal_draft_lengths(probs, caps, curve, rc)
    assert all(0 <= ki <= ci for ki, ci in zip(k, caps))
    assert num / den == pytest.approx(obj(k), rel=1e-9)
    best = max(obj(ks) for ks in itertools.product(*(range(c + 1) for c in caps)))
    assert obj(k) == pytest.approx(best, rel=1e-9) if linear else obj(k) >= 0.95 * best


