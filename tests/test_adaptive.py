"""Adaptive speculation-length controller: optimality, limits, learning, probing."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.api.spec_config import SpeculativeConfig
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.acceptance import AcceptanceEstimator
from tokenbudget.spec.adaptive import (
    AdaptiveSpecController,
    expected_tokens,
    optimal_draft_lengths,
)
from tokenbudget.spec.cost_model import StepCostModel


def _e(row, k):
    """E(k) = 1 + sum_{j<k} prod_{l<=j} a_l, computed the slow way."""
    return 1.0 + sum(math.prod(row[: j + 1]) for j in range(k))


def _objective(probs, ks, base, cost, per_draft):
    d = sum(ks)
    return sum(_e(r, k) for r, k in zip(probs, ks)) / (cost[base + len(ks) + d] + per_draft * d)


_prob = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.5, 1.0]))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_optimal_against_brute_force(data):
    b = data.draw(st.integers(1, 4), label="B")
    kmax = data.draw(st.integers(1, 4), label="K")
    probs = [data.draw(st.lists(_prob, min_size=kmax, max_size=kmax)) for _ in range(b)]
    caps = data.draw(st.lists(st.integers(0, kmax), min_size=b, max_size=b))
    base = data.draw(st.integers(0, 5))
    n = base + b * (kmax + 1) + 1
    monotone = data.draw(st.booleans())
    steps = data.draw(st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n))
    if monotone:
        cost = list(itertools.accumulate(steps, initial=data.draw(st.floats(0.01, 10.0))))
    else:  # exactness needs no monotonicity: any positive table
        cost = [s + 0.01 for s in steps]
    per_draft = data.draw(st.sampled_from([0.0, 0.0, 0.1, 1.0]))
    table = np.array(cost)
    k, num, den = optimal_draft_lengths(
        np.array(probs), np.array(caps), base, lambda t: table[t],
        (lambda d: per_draft * d) if per_draft else None)
    assert all(0 <= ki <= ci for ki, ci in zip(k, caps))
    got = _objective(probs, list(k), base, cost, per_draft)
    assert num / den == pytest.approx(got, rel=1e-9)
    best = max(_objective(probs, ks, base, cost, per_draft)
               for ks in itertools.product(*(range(c + 1) for c in caps)))
    assert got == pytest.approx(best, rel=1e-9)


def test_expected_tokens():
    a = np.array([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]])
    assert expected_tokens(a, np.array([3, 3])).tolist() == pytest.approx([2.0, 2.0])
    assert expected_tokens(a, np.array([0, 1])).tolist() == pytest.approx([1.0, 2.0])


def _reqs(n, **kw):
    return [Request(f"r{i}", [1, 2, 3], **kw) for i in range(n)]


def _ctrl(cost, max_k=4, **kw):
    return AdaptiveSpecController(max_k, cost_model=cost, **kw)


FLAT = StepCostModel.from_measurements([(1, 1.0), (4096, 1.0)])
LINEAR = StepCostModel.from_measurements([(1, 1.0), (4096, 4096.0)])   # compute-bound


@pytest.mark.parametrize("b", [1, 8, 64])
def test_no_speculation_when_cost_grows_with_every_token(b):
    ctrl = _ctrl(LINEAR, prior_alpha=99.0, prior_beta=1.0)   # even with acceptance ~0.99
    reqs = _reqs(b)
    for _ in range(100):                                       # probing does not pay either
        assert ctrl.choose(reqs) == [0] * b
    assert ctrl.num_probes == 0 and ctrl.k_histogram == {0: 100 * b}


def test_no_speculation_when_acceptance_is_zero():
    ctrl = _ctrl(FLAT, probe_interval=0)
    reqs = _reqs(4)
    for r in reqs:
        for _ in range(200):
            ctrl.observe(r.request_id, 4, 0)
    ctrl.acceptance.global_succ[:] = 0.0
    ctrl.acceptance.global_trials[:] = 1e9                     # engine-wide rate ~0 too
    assert ctrl.choose(reqs) == [0, 0, 0, 0]


def test_max_speculation_when_cost_flat_and_acceptance_high():
    ctrl = _ctrl(FLAT, max_k=6, prior_alpha=999.0, prior_beta=1.0)
    assert ctrl.choose(_reqs(16), base_tokens=100) == [6] * 16
    assert ctrl.last_plan.expected_tokens > 16 * 6.5


def test_roofline_speculates_less_as_the_batch_grows():
    cost = StepCostModel.linear(1.0, 1.0 / 64, max_tokens=4096, knee_tokens=64)
    drafts = []
    for b in (1, 8, 32, 128, 512):
        ctrl = _ctrl(cost, max_k=8, prior_alpha=7.0, prior_beta=3.0, probe_interval=0)
        drafts.append(sum(ctrl.choose(_reqs(b))) / b)
    assert drafts == sorted(drafts, reverse=True)

    def best_uniform_k(b: int) -> int:  # brute force over one k for all b requests, prior mean 0.7
        return max(range(9), key=lambda k: b * _e([0.7] * 8, k) / cost.cost(b * (1 + k)))
    # the ends are the brute-force optima, and they differ (the premise of "less as the batch grows")
    assert (drafts[0], drafts[-1]) == (best_uniform_k(1), best_uniform_k(512)) and drafts[0] > drafts[-1]


def test_per_request_caps():
    ctrl = _ctrl(FLAT, max_k=4, prior_alpha=999.0, prior_beta=1.0, probe_interval=1)
    reqs = [Request("a", [1]), Request("b", [1], max_spec_tokens=0),
            Request("c", [1], max_spec_tokens=2), Request("d", [1], max_spec_tokens=9)]
    for _ in range(5):   # a disabled request is never probed either
        assert ctrl.choose(reqs) == [4, 0, 2, 4]
    assert ctrl.choose(reqs, caps=[1, 4, 4, 0]) == [1, 0, 2, 0]
    with pytest.raises(ValueError):
        ctrl.choose(reqs, caps=[1])
    with pytest.raises(ValueError):
        ctrl.choose(reqs, base_tokens=-1)


def test_drafter_cost():
    reqs = _reqs(4)
    free = _ctrl(FLAT, prior_alpha=9.0, prior_beta=1.0, probe_interval=0)
    assert free.choose(reqs) == [4] * 4
    costly = _ctrl(FLAT, prior_alpha=9.0, prior_beta=1.0, probe_interval=0, drafter_cost=1.0)
    assert costly.choose(reqs) == [0] * 4
    per_d = StepCostModel.from_measurements([(1, 0.01), (64, 0.64)])
    modelled = _ctrl(FLAT, prior_alpha=9.0, prior_beta=1.0, probe_interval=0,
                     drafter_cost=per_d)
    assert modelled.choose(reqs) == [4] * 4


def test_choose_matches_the_pure_optimiser():
    rng = random.Random(0)
    cost = StepCostModel.linear(1.0, 1.0 / 32, knee_tokens=32)
    ctrl = _ctrl(cost, max_k=5, probe_interval=0)
    reqs = _reqs(40)
    for step in range(50):
        ks = ctrl.choose(reqs, base_tokens=rng.randint(0, 40))
        for i, (r, k) in enumerate(zip(reqs, ks)):
            acc = 0
            while acc < k and rng.random() < (i + 1) / 41:
                acc += 1
            ctrl.observe(r.request_id, k, acc)
    ks = ctrl.choose(reqs, base_tokens=7)
    slots = ctrl.acceptance.slots([r.request_id for r in reqs])
    want, num, den = optimal_draft_lengths(ctrl.acceptance.probs(slots), np.full(40, 5), 7,
                                           cost.cost, min_gain=ctrl.min_draft_gain)
    assert ks == want.tolist()
    assert ctrl.last_plan.ratio == pytest.approx(num / den)
    assert sum(ks[:10]) <= sum(ks[-10:])     # better acceptors draft more


def _simulate_accept(rng, k, rates):
    acc = 0
    while acc < k and rng.random() < rates[acc]:
        acc += 1
    return acc


@pytest.mark.parametrize("decay, tol", [(1.0, 0.03), (0.95, 0.1)])
def test_estimates_converge_to_true_acceptance(decay, tol):
    rng = random.Random(1)
    true = [0.8, 0.6, 0.5, 0.3]
    ctrl = _ctrl(FLAT, decay=decay)
    reqs = _reqs(1)
    history = []
    for _ in range(4000):
        (k,) = ctrl.choose(reqs)
        assert k == 4                                  # flat cost: always worth the max
        ctrl.observe("r0", k, _simulate_accept(rng, k, true))
        history.append(ctrl.estimate("r0"))
    mean = np.mean(history[-2000:], axis=0)
    assert mean == pytest.approx(true, abs=tol)
    g = ctrl.acceptance.global_probs()
    assert g.tolist() == pytest.approx(true, abs=0.15)


@pytest.mark.parametrize("seed", range(8))
def test_stopped_request_resumes_when_acceptance_improves(seed):
    """Bounds derived, not fit to one trajectory (checked over seeds): while acceptance is 0.05 a
    draft does not pay, so only probes draft (k = 1, at most one per ``probe_interval`` steps);
    once it is 0.95, k is the optimum ``optimal_draft_lengths`` gives at the true rates."""
    rng = random.Random(seed)
    cost = StepCostModel.linear(1.0, 0.3, max_tokens=64)      # a draft pays iff its E > 0.3
    ctrl = _ctrl(cost)
    reqs = _reqs(1)
    ks, probed = [], []
    for step in range(900):
        rates = [0.05] * 4 if step < 300 else [0.95] * 4
        probes = ctrl.num_probes
        (k,) = ctrl.choose(reqs)
        ks.append(k)
        probed.append(ctrl.num_probes > probes)
        ctrl.observe("r0", k, _simulate_accept(rng, k, rates))

    def optimum(rate: float) -> int:
        return int(optimal_draft_lengths(np.array([[rate] * 4]), np.full(1, 4), 0, cost.cost,
                                         min_gain=ctrl.min_draft_gain)[0][0])
    assert (optimum(0.05), optimum(0.5), optimum(0.95)) == (0, 1, 4)  # the premises below
    assert ks[0] == optimum(0.5)  # the prior's mean 0.5: starts drafting
    window = range(200, 300)  # stopped: only probes draft, one draft each, spaced by probe_interval
    assert all(ks[i] == 0 or (ks[i] == 1 and probed[i]) for i in window)
    assert sum(ks[i] > 0 for i in window) <= -(-len(window) // ctrl.probe_interval)
    assert ks[-100:] == [optimum(0.95)] * 100  # drafting again, as deep as the true rates pay
    assert ctrl.num_probes > 0


def test_forget_and_slot_reuse():
    ctrl = _ctrl(FLAT)
    for _ in range(50):
        ctrl.observe("x", 4, 0)
    assert ctrl.estimate("x")[0] < 0.1
    ctrl.forget("x")
    assert "x" not in ctrl.acceptance
    g = ctrl.acceptance.global_probs().tolist()
    assert ctrl.estimate("x") == pytest.approx(g)
    ctrl.observe("y", 1, 1)                  # reuses the freed row, starting clean
    assert ctrl.estimate("y")[1] == pytest.approx(ctrl.acceptance.global_probs()[1])
    ctrl.forget("never-seen")                # no error


def test_estimator_growth_and_validation():
    est = AcceptanceEstimator(3, initial_slots=2)
    for i in range(10):
        est.observe(f"r{i}", 3, i % 4)
    assert len(est) == 10
    with pytest.raises(ValueError):
        est.observe("r0", 2, 3)
    with pytest.raises(ValueError):
        AcceptanceEstimator(0)
    est.observe("r0", 0, 0)                  # plain decode: no evidence
    est.observe("r0", 9, 9)                  # more drafts than max_k: counted up to max_k
    assert est.estimate("r0")[2] > 0.0


def test_position_model_counts_only_tested_positions():
    est = AcceptanceEstimator(4, prior_strength=1e-9, decay=1.0)
    est.observe("r", 4, 1)                   # pos 0 accepted, pos 1 rejected, 2-3 untested
    est.observe("r", 4, 3)
    a = est.estimate("r")
    assert a[:3] == pytest.approx([1.0, 0.5, 1.0])
    assert est.global_trials.tolist() == [2, 2, 1, 1]
    assert est.global_succ.tolist() == [2, 1, 1, 0]


def test_untested_positions_inherit_the_deepest_measured_rate():
    est = AcceptanceEstimator(4, prior_alpha=1.0, prior_beta=1.0, decay=1.0)
    for _ in range(1000):
        est.observe("r", 1, 1)               # only position 0 ever tested, always accepted
    g = est.global_probs()
    assert g[0] > 0.99 and g[3] == pytest.approx(g[0])
    assert est.estimate("r")[3] == pytest.approx(g[3])


def test_from_config_and_histogram():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens="auto")
    ctrl = AdaptiveSpecController.from_config(cfg, cost_model=FLAT, prior_alpha=9.0)
    assert ctrl.max_k == cfg.max_spec_tokens
    assert ctrl.choose([]) == []
    ctrl.choose(_reqs(3))
    assert ctrl.k_histogram == {cfg.max_spec_tokens: 3}
    ctrl.observe_step(10, 1.0)
    assert ctrl.cost_model.num_updates == 1


def test_per_request_cost_is_a_constant_within_a_step():
    """With c(T, B) = h(T) + beta * (B - 1), choose() is the exact optimum with T -> c(T, B_step)
    (B_step = listed requests + base_requests); a larger per-request overhead makes drafts
    relatively cheaper, never more expensive."""
    h = StepCostModel.linear(1.0, 0.1, max_tokens=256)
    rng = np.random.default_rng(3)
    for trial in range(40):
        b = int(rng.integers(1, 5))
        kmax = 3
        probs = rng.uniform(0, 1, size=(b, kmax))
        beta = float(rng.uniform(0, 2))
        extra = int(rng.integers(0, 3))
        m = StepCostModel.linear(1.0, 0.1, max_tokens=256, per_request=beta)
        best = max(itertools.product(range(kmax + 1), repeat=b),
                   key=lambda ks: sum(_e(list(p), k) for p, k in zip(probs, ks))
                   / (h.cost(5 + b + sum(ks)) + beta * (b + extra - 1)))
        ctrl = AdaptiveSpecController(kmax, cost_model=m, probe_interval=0, min_draft_gain=0.0)
        got = optimal_draft_lengths(probs, np.full(b, kmax), 5, ctrl._target_cost(b + extra))[0]
        obj = lambda ks: sum(_e(list(p), k) for p, k in zip(probs, ks)) / (
            h.cost(5 + b + sum(ks)) + beta * (b + extra - 1))
        assert obj(got) == pytest.approx(obj(best))


def test_observe_step_with_requests_feeds_the_per_request_term():
    m = StepCostModel.linear(0.01, 0.0001, max_tokens=256)
    ctrl = AdaptiveSpecController(4, cost_model=m)
    before = m.cost(64)
    for _ in range(500):
        ctrl.observe_step(64, m.cost(64) + 0.001 * 63, num_requests=64)
    assert m.per_request == pytest.approx(0.001, rel=0.05)
    assert m.cost(64) == pytest.approx(before, rel=0.01)
    reqs = _reqs(2)
    assert len(ctrl.choose(reqs, base_tokens=3, base_requests=3)) == 2
    with pytest.raises(ValueError):
        ctrl.choose(reqs, base_requests=-1)
