"""Step cost model: the fit recovers the costs that generated the step times, learns new ones
online, stays non-negative, shrugs off outliers; the shape of a scheduled step is counted right."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.scheduler.output import ScheduledRequest, SchedulerOutput
from tokenbudget.spec.cost_model import StepCostModel, nonnegative_least_squares, synthetic_model
from tokenbudget.spec.step_shape import FEATURES, StepShape, default_grid, request_attention, step_shape

TRUE = dict(step=3e-3, per_request=2e-4, per_token=1e-5, per_logit_row=1.5e-4, per_kkey=2e-3,
            hinges=(3e-4, 1e-4))


def _true_cost(shape: StepShape, w: dict) -> float:
    h = list(w.get("hinges", ())) + [0.0] * (len(FEATURES) - 5 - len(w.get("hinges", ())))
    vec = np.array([w.get("step", 0), w.get("per_request", 0), w.get("per_token", 0),
                    w.get("per_logit_row", 0), w.get("per_kkey", 0)] + h)
    return float(shape.features() @ vec)


def _random_shapes(rng, n):
    out = []
    for _ in range(n):
        b = int(rng.integers(1, 65))
        k = int(rng.integers(0, 9)) * int(rng.random() < 0.5)
        prefill = int(rng.integers(0, 300)) * int(rng.random() < 0.2)
        ctx = rng.integers(10, 1500, size=b)
        att = sum(request_attention(int(c), 1 + k) for c in ctx)
        out.append(StepShape(b + (prefill > 0), b * (1 + k) + prefill, b * (1 + k), att))
    return out


def test_synthetic_prior_is_recovered_exactly():
    m = synthetic_model(**TRUE)
    rng = np.random.default_rng(0)
    for shape in _random_shapes(rng, 50):
        assert m.cost(shape) == pytest.approx(_true_cost(shape, TRUE), rel=1e-3)


def test_online_updates_learn_the_machine_it_runs_on():
    """Start from a prior off by 2x in different directions (measured on the runner alone, on a
    quieter machine); after a few hundred steps of the real step times (2% noise) the
    predictions are within a few percent."""
    m = synthetic_model(step=1.5e-3, per_request=4e-4, per_token=0.0, per_logit_row=3e-4,
                        per_kkey=1e-3, hinges=(1.5e-4, 2e-4), forget=0.995)
    rng = np.random.default_rng(1)
    shapes = _random_shapes(rng, 800)
    for s in shapes:
        m.update(s, _true_cost(s, TRUE) * (1 + 0.02 * rng.standard_normal()))
    errs = [abs(m.cost(s) / _true_cost(s, TRUE) - 1) for s in _random_shapes(rng, 200)]
    assert np.median(errs) < 0.04 and max(errs) < 0.25
    assert m.num_updates == 800


def test_directions_the_online_steps_do_not_excite_keep_the_prior():
    """Only plain batch-8 decode steps online: the cost of a draft row stays the prior's."""
    m = synthetic_model(**TRUE)
    base = StepShape(8, 8, 8, 8 * request_attention(200, 1))
    draft = StepShape(8, 16, 16, 8 * request_attention(200, 2))
    before = m.cost(draft) - m.cost(base)
    for _ in range(2000):
        m.update(base, 1.5 * _true_cost(base, TRUE))       # the machine got slower
    assert m.cost(base) == pytest.approx(1.5 * _true_cost(base, TRUE), rel=0.02)
    assert before * 0.5 < m.cost(draft) - m.cost(base) < before * 2.5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 8), st.integers(0, 2000),
                          st.floats(1e-5, 1.0)), min_size=1, max_size=30))
def test_weights_stay_non_negative_whatever_the_data(steps):
    m = synthetic_model(**TRUE)
    for b, k, ctx, seconds in steps:
        m.update(StepShape(b, b * (1 + k), b * (1 + k), b * request_attention(ctx, 1 + k)), seconds)
        assert np.all(m.weights >= 0)
        assert m.cost(StepShape(1, 1, 1, 0.0)) > 0


def test_one_outlier_moves_the_prediction_little():
    m = synthetic_model(**TRUE)
    s = StepShape(4, 4, 4, 1.0)
    before = m.cost(s)
    m.update(s, 100 * before)           # a GC pause
    assert m.cost(s) < 3 * before


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.data())
def test_nnls_against_brute_force(n, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 10**6)))
    x = rng.standard_normal((n + 3, n))
    a = x.T @ x + 1e-3 * np.eye(n)
    b = rng.standard_normal(n)
    start = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    w = nonnegative_least_squares(a, b, start)  # a warm start (any guess) changes nothing

    def obj(v):
        return float(v @ a @ v - 2 * b @ v)
    best = np.inf
    for free in itertools.product([0, 1], repeat=n):
        idx = np.flatnonzero(free)
        v = np.zeros(n)
        if len(idx):
            v[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
        if np.all(v >= -1e-12):
            best = min(best, obj(np.maximum(v, 0)))
    assert np.all(w >= 0)
    assert obj(w) <= best + 1e-9 * (1 + abs(best))


def test_step_shape_counts_rows_logits_and_keys():
    sched = SchedulerOutput([
        ScheduledRequest(request_id="decode", num_computed_tokens=100, token_ids=[5], spec_token_ids=[],
                         block_ids=[0], is_new=False, needs_sample=True),
        ScheduledRequest(request_id="verify", num_computed_tokens=50, token_ids=[5, 6, 7], spec_token_ids=[6, 7],
                         block_ids=[1], is_new=False, needs_sample=True),
        ScheduledRequest(request_id="prefill", num_computed_tokens=0, token_ids=[1] * 16, spec_token_ids=[],
                         block_ids=[2], is_new=True, needs_sample=False),
    ], 20)
    s = step_shape(sched)
    assert (s.requests, s.tokens, s.logit_rows) == (3, 20, 4)
    assert s.attention == pytest.approx((101 + 51 + 52 + 53 + sum(range(1, 17))) / 1000)


def test_bad_input_raises():
    with pytest.raises(ValueError):
        StepCostModel([])
    with pytest.raises(ValueError):
        StepCostModel([(StepShape(1, 1, 1, 0.0), 0.0)])
    with pytest.raises(ValueError):
        StepCostModel([(StepShape(1, 1, 1, 0.0), 1.0)], forget=0.0)
    m = synthetic_model(step=1.0)
    with pytest.raises(ValueError):
        m.update(StepShape(1, 1, 1, 0.0), float("nan"))
    with pytest.raises(ValueError):
        synthetic_model(step=-1.0)
    assert default_grid(5) == [1, 2, 4, 5]
    with pytest.raises(ValueError):
        default_grid(0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 64), st.integers(0, 400), st.integers(0, 80), st.floats(0.0, 50.0), st.integers(0, 300))
def test_token_curve_is_the_cost_of_the_step_with_d_more_rows(b, tokens, logit_rows, att, n):
    """The controller prices D drafts with ``token_curve``: it must be ``cost`` of the same step
    with D more rows needing logits (hinges included), for every D."""
    m = synthetic_model(**TRUE)
    base = StepShape(b, tokens, logit_rows, att)
    g = m.token_curve(base, n)
    assert len(g) == n + 1
    for d in sorted({0, 1, n // 2, n} | {max(0, k - tokens + s) for k in (4, 16, 64, 256) for s in (0, 1)}):
        if d <= n:
            want = m.cost(StepShape(b, tokens + d, logit_rows + d, att))
            assert g[d] == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_team_rows_is_the_c_kernels_team_threshold():
    """The cost model's ``TEAM_ROWS`` knot is where the C kernels start their thread team."""
    import re
    from pathlib import Path

    from tokenbudget.spec.step_shape import TEAM_ROWS
    header = Path(__file__).resolve().parents[1] / "kernels" / "cpu" / "quant_gemm.h"
    assert int(re.search(r"#define TEAM_MIN_ROWS (\d+)", header.read_text()).group(1)) == TEAM_ROWS


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 40), st.floats(0.8, 0.999))
def test_a_batched_fold_is_one_fold_per_update(seed, n, forget):
    """``_fold_pending`` folds the updates since the last refit in one batch; its docstring
    promises exactly what folding each update on its own gives (update i of n discounted by
    forget^(n-1-i)). One model refits after every update (batches of one), the other once at
    the end; no clipping (a huge ``max_update_factor``), so they see the same seconds."""
    rng = np.random.default_rng(seed)
    shapes = _random_shapes(rng, n)
    seconds = [_true_cost(s, TRUE) * float(rng.uniform(0.5, 2.0)) for s in shapes]
    one_by_one = synthetic_model(**TRUE, forget=forget, refit_every=1, max_update_factor=1e12)
    batched = synthetic_model(**TRUE, forget=forget, refit_every=10**9, max_update_factor=1e12)
    for s, sec in zip(shapes, seconds):
        one_by_one.update(s, sec)
        one_by_one.refit()
        batched.update(s, sec)
    batched.refit()
    np.testing.assert_allclose(batched.weights, one_by_one.weights, rtol=1e-6, atol=1e-12)
