"""StepCostModel: interpolation, extrapolation, monotonicity, online updates, measuring."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.spec.cost_model import (
    StepCostModel,
    default_grid,
    isotonic_non_decreasing,
    measure_step_costs,
)


def test_interpolation_and_extrapolation():
    m = StepCostModel.from_measurements([(1, 1.0), (10, 2.0), (20, 4.0)])
    assert m.cost(1) == pytest.approx(1.0)
    assert m.cost(5.5) == pytest.approx(1.5)
    assert m.cost(15) == pytest.approx(3.0)
    assert m.cost(30) == pytest.approx(6.0)      # last slope (0.2 / token) continues
    assert m(0) == pytest.approx(1.0)            # flat below the first bucket
    arr = m.cost(np.array([1, 10, 15]))
    assert isinstance(arr, np.ndarray) and arr.tolist() == pytest.approx([1.0, 2.0, 3.0])


def test_from_measurements_averages_repeats():
    m = StepCostModel.from_measurements([(4, 1.0), (4, 3.0), (8, 5.0)])
    assert m.points == [(4, pytest.approx(2.0)), (8, pytest.approx(5.0))]


def test_monotone_enforced():
    m = StepCostModel.from_measurements([(1, 1.0), (2, 3.0), (4, 2.0), (8, 4.0)])
    fitted = [c for _, c in m.points]
    assert fitted == pytest.approx([1.0, 2.5, 2.5, 4.0])   # the L2 projection (PAV)
    xs = np.arange(0, 20)
    assert np.all(np.diff(m.cost(xs)) >= 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=12),
       st.data())
def test_isotonic_is_monotone_and_optimal(ys, data):
    ws = data.draw(st.lists(st.floats(0.5, 5), min_size=len(ys), max_size=len(ys)))
    fit = isotonic_non_decreasing(ys, ws)
    assert np.all(np.diff(fit) >= -1e-9)
    # Weighted means are preserved (a property of the projection).
    assert np.dot(fit, ws) == pytest.approx(np.dot(ys, ws), rel=1e-9, abs=1e-9)
    if len(ys) <= 4:   # against brute force on a grid of monotone candidates built from ys
        err = float(np.dot(ws, (fit - np.array(ys)) ** 2))
        for cand in itertools.combinations_with_replacement(sorted(set(ys)), len(ys)):
            assert err <= float(np.dot(ws, (np.array(cand) - np.array(ys)) ** 2)) + 1e-7


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.floats(0, 10, allow_nan=False)),
                min_size=1, max_size=20),
       st.lists(st.tuples(st.integers(1, 8192), st.floats(0, 10, allow_nan=False)),
                max_size=20))
def test_monotone_after_any_updates(meas, updates):
    m = StepCostModel.from_measurements(meas)
    for t, s in updates:
        m.update(t, s)
    xs = np.arange(1, 10000, 37)
    c = m.cost(xs)
    assert np.all(np.diff(c) >= -1e-12) and np.all(c > 0)


def test_online_update_converges_to_new_cost():
    grid = default_grid(512)
    m = StepCostModel.from_measurements([(t, 1.0 + 0.01 * t) for t in grid], ewma=0.2)
    true = lambda t: 2.0 + 0.02 * t  # the machine got slower
    for _ in range(80):
        for t in (1, 3, 16, 100, 512):
            m.update(t, true(t))
    for t in (1, 16, 512):
        assert m.cost(t) == pytest.approx(true(t), rel=0.05)


def test_update_between_buckets_is_shifted_to_the_nearest_bucket():
    m = StepCostModel.from_measurements([(10, 1.0), (20, 2.0)], ewma=1.0)
    m.update(12, 1.2 + 0.5)         # 0.5 slower than the model at T=12
    assert m.points[0] == (10, pytest.approx(1.5))
    assert m.points[1] == (20, pytest.approx(2.0))


def test_update_is_clipped_against_outliers():
    m = StepCostModel.from_measurements([(8, 1.0)], ewma=1.0, max_update_factor=3.0)
    m.update(8, 1000.0)
    assert m.cost(8) == pytest.approx(3.0)


def test_update_outside_range_adds_a_bucket():
    m = StepCostModel.from_measurements([(1, 1.0), (64, 2.0)])
    m.update(256, 8.0)
    assert m.points[-1] == (256, pytest.approx(8.0))
    m.update(70, 2.0)               # inside +25 %: folded into the 64 bucket
    assert len(m.points) == 3


def test_bad_input_raises():
    with pytest.raises(ValueError):
        StepCostModel.from_measurements([])
    with pytest.raises(ValueError):
        StepCostModel([1, 1], [1.0, 2.0])
    with pytest.raises(ValueError):
        StepCostModel([0], [1.0])
    m = StepCostModel([1], [1.0])
    with pytest.raises(ValueError):
        m.update(0, 1.0)
    with pytest.raises(ValueError):
        m.update(4, float("nan"))


def test_default_grid():
    assert default_grid(1) == [1]
    assert default_grid(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert default_grid(64) == [1, 2, 4, 8, 16, 32, 64]


def test_measure_step_costs_with_fake_clock():
    clock = [0.0]
    calls: list[int] = []

    def timer():
        return clock[0]

    def run_forward(t):
        calls.append(t)
        clock[0] += 0.5 + 0.001 * t + (5.0 if len(calls) == 1 else 0.0)  # slow first call

    m = measure_step_costs(run_forward, [64, 1, 16], warmup=1, repeats=3, timer=timer)
    assert calls == [1] * 4 + [16] * 4 + [64] * 4
    for t in (1, 16, 64):
        assert m.cost(t) == pytest.approx(0.5 + 0.001 * t)
    with pytest.raises(ValueError):
        measure_step_costs(run_forward, [])


# ---- per-request term: cost(T, B) = h(T) + per_request * (B - 1) ----

def _h_true(t):
    return 0.03 + 0.0005 * t


def test_per_request_term_is_additive_and_backward_compatible():
    m = StepCostModel.from_measurements([(1, 1.0), (10, 2.0)], per_request=0.5)
    assert m.cost(5) == pytest.approx(m.cost(5, 1))          # no B: the T curve alone
    assert m.cost(5, 4) == pytest.approx(m.cost(5) + 1.5)
    assert np.allclose(m.cost(np.array([1, 10]), 3), [2.0, 3.0])
    m.update(5, 0.0)                                          # no B: term untouched
    assert m.per_request == 0.5


def test_per_request_term_converges_on_synthetic_data():
    grid = default_grid(256)
    m = StepCostModel(grid, [_h_true(t) for t in grid])       # single-request probe: exact h
    rng = np.random.default_rng(0)
    beta = 0.002
    for _ in range(3000):
        b = int(rng.choice([1, 4, 16, 64]))
        t = b * int(rng.integers(1, 5))
        m.update(t, (_h_true(t) + beta * (b - 1)) * rng.uniform(0.95, 1.05), num_requests=b)
    assert m.per_request == pytest.approx(beta, rel=0.1)
    for t, c in m.points:
        if t <= 256:
            assert c == pytest.approx(_h_true(t), rel=0.1)


def test_updates_at_varying_batch_size_do_not_inflate_the_token_curve():
    grid = default_grid(256)
    start = [_h_true(t) for t in grid]
    beta = 0.004                      # 64 requests: ~8x the single-request cost at T = 64
    rng = np.random.default_rng(1)
    with_b = StepCostModel(grid, start)
    with_b.fit_per_request([(b, b, _h_true(b) + beta * (b - 1)) for b in (1, 4, 16)])
    assert with_b.per_request == pytest.approx(beta)
    without_b = StepCostModel(grid, start)
    for _ in range(2000):
        b = int(rng.choice([4, 16, 64]))
        t = b * int(rng.integers(1, 4))
        s = _h_true(t) + beta * (b - 1)
        with_b.update(t, s, num_requests=b)
        without_b.update(t, s)
    for (t, c), c0 in zip(with_b.points, start):
        assert c == pytest.approx(c0, rel=0.02)
    assert with_b.per_request == pytest.approx(beta, rel=0.02)
    # the old model (no B) drags the buckets up: that is the bug this term fixes
    assert without_b.cost(64) > 2 * _h_true(64)


def test_per_request_update_is_clipped_and_never_negative():
    m = StepCostModel([1, 16], [1.0, 1.0], per_request=0.1)
    m.set_per_request(0.1, weight=1.0)
    m.update(16, 1e6, num_requests=16)                        # one stall: bounded move
    assert m.per_request < 0.1 * 3 + 1.0
    for _ in range(500):
        m.update(16, 0.5, num_requests=16)                    # faster than h alone
    assert m.per_request >= 0.0
    assert m.cost(16, 16) == pytest.approx(0.5, rel=0.05)
    m2 = StepCostModel([1, 16], [1.0, 1.0])
    m2.update(16, 0.5, num_requests=16)                       # residual < 0: clipped at 0
    assert m2.per_request == 0.0
