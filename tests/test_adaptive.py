"""Adaptive speculation-length controller: optimality, limits, learning, probing."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from controller_helpers import controller as _ctrl
from controller_helpers import decoding_requests as _reqs
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.api.spec_config import SpeculativeConfig
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.acceptance import AcceptanceEstimator
from tokenbudget.spec.adaptive import AdaptiveSpecController
from tokenbudget.spec.cost_model import synthetic_model
from tokenbudget.spec.draft_lengths import optimal_draft_lengths
from tokenbudget.spec.step_shape import StepShape, request_attention


def _e(row, k):
    """E(k) = 1 + sum_{j<k} prod_{l<=j} a_l, computed the slow way."""
    return 1.0 + sum(math.prod(row[: j + 1]) for j in range(k))


FLAT = synthetic_model(step=1.0)                              # drafts are free
ROWS = synthetic_model(per_logit_row=1.0)                     # every row costs the same


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 64), st.lists(st.floats(0.0, 0.9), min_size=4, max_size=4),
       st.floats(0.0, 0.1), st.sampled_from([0.0, 1e-3, 0.05]), st.integers(0, 2000))
def test_no_speculation_when_verify_rows_cost_more_than_they_return(b, acc, share, kkey, ctx):
    """Rows cost r each and the step's fixed cost is a small share of its rows' (F = share*B*r):
    the average cost per token is r (1 + share), so a draft (one more row, and its keys) pays
    only if it returns more than 1 / (1 + share) > 0.9 tokens. With acceptance <= 0.9 no draft
    does, whatever the batch, the context or the acceptance pattern below it: k = 0 for all."""
    cost = synthetic_model(step=share * b, per_logit_row=1.0, per_kkey=kkey)
    ctrl = _ctrl(cost, prior_alpha=1.0, prior_beta=1.0)
    reqs = _reqs(b, context=ctx)
    ctrl.acceptance.global_succ[:] = [a * 1e9 for a in acc]
    ctrl.acceptance.global_trials[:] = [1e9] * 4
    for _ in range(20):                                        # probing does not pay either
        assert ctrl.choose(reqs) == [0] * b
    assert ctrl.num_probes == 0


def test_no_speculation_when_acceptance_is_zero():
    ctrl = _ctrl(synthetic_model(step=1.0, per_logit_row=0.01), probe_interval=0)
    reqs = _reqs(4)
    for r in reqs:
        for _ in range(200):
            ctrl.observe(r.request_id, 4, 0)
    ctrl.acceptance.global_succ[:] = [0.0] * 4
    ctrl.acceptance.global_trials[:] = [1e9] * 4               # engine-wide rate ~0 too
    assert ctrl.choose(reqs) == [0, 0, 0, 0]


def test_max_speculation_when_cost_flat_and_acceptance_high():
    ctrl = _ctrl(FLAT, max_k=6, prior_alpha=999.0, prior_beta=1.0)
    assert ctrl.choose(_reqs(16), base=StepShape(1, 100, 0, 5.0)) == [6] * 16
    assert ctrl.last_plan.expected_tokens > 16 * 6.5


def test_shorter_drafts_as_the_batch_grows():
    """A memory-bound step (fixed cost, cheap rows): drafts are nearly free at batch 1 and
    compete with the other requests' decode rows as the batch grows."""
    cost = synthetic_model(step=1.0, per_request=0.005, per_logit_row=1.0 / 32)
    drafts = []
    for b in (1, 8, 32, 128, 512):
        ctrl = _ctrl(cost, max_k=8, prior_alpha=7.0, prior_beta=3.0, probe_interval=0)
        drafts.append(sum(ctrl.choose(_reqs(b))) / b)
    assert drafts == sorted(drafts, reverse=True)

    def best_uniform_k(b: int) -> int:  # brute force over one k for all b requests, prior mean 0.7
        return max(range(9), key=lambda k: b * _e([0.7] * 8, k) / cost.cost(
            StepShape(b, b * (1 + k), b * (1 + k), b * request_attention(2, 1 + k))))
    # the ends are the brute-force optima, and they differ (the premise of "shorter as B grows")
    assert (drafts[0], drafts[-1]) == (best_uniform_k(1), best_uniform_k(512)) and drafts[0] > drafts[-1]


def test_long_contexts_get_fewer_drafts():
    """Same acceptance, same batch: a verify row over a 4000-token context costs attention over
    4000 keys, so it gets fewer drafts than one over 20 tokens."""
    cost = synthetic_model(step=1.0, per_logit_row=0.02, per_kkey=0.2)
    ctrl = _ctrl(cost, max_k=8, prior_alpha=8.0, prior_beta=2.0, probe_interval=0)
    short, long = _reqs(1, context=20), _reqs(1, context=4000)
    long[0].request_id = "long"
    ks = ctrl.choose(short + long)
    assert ks[0] > ks[1]


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
        ctrl.choose(reqs, base=StepShape(-1, 0, 0, 0.0))


def test_choose_matches_the_pure_optimiser():
    rng = random.Random(0)
    cost = synthetic_model(step=1.0, per_logit_row=1.0 / 32, per_kkey=0.01)
    ctrl = _ctrl(cost, max_k=5, probe_interval=0)
    reqs = _reqs(40, context=300)
    for step in range(50):
        ks = ctrl.choose(reqs, base=StepShape(1, rng.randint(0, 40), 0, 0.0))
        for i, (r, k) in enumerate(zip(reqs, ks)):
            acc = 0
            while acc < k and rng.random() < (i + 1) / 41:
                acc += 1
            ctrl.observe(r.request_id, k, acc)
    base = StepShape(1, 7, 0, 0.0)
    ks = ctrl.choose(reqs, base=base)
    rows = ctrl.acceptance.rows([r.request_id for r in reqs])
    curve, rc = ctrl.step_costs(reqs, base)
    want, num, den = optimal_draft_lengths(ctrl.acceptance.probs(rows), [5] * 40, curve, rc)
    assert ks == want
    assert ctrl.last_plan.ratio == pytest.approx(num / den)
    assert sum(ks[:10]) <= sum(ks[-10:])     # better acceptors draft more


def test_plan_cost_is_the_models_cost_of_the_step_it_plans():
    cost = synthetic_model(step=1e-3, per_request=1e-4, per_token=1e-5, per_logit_row=2e-4,
                           per_kkey=1e-3, hinges=(1e-4,))
    ctrl = _ctrl(cost, max_k=4, prior_alpha=9.0, prior_beta=1.0, probe_interval=0)
    reqs = _reqs(3, context=500)
    base = StepShape(1, 40, 0, request_attention(100, 40))
    ks = ctrl.choose(reqs, base=base)
    att = base.attention + sum(request_attention(500, 1 + k) for k in ks)
    rows = sum(1 + k for k in ks)
    shape = StepShape(base.requests + 3, base.tokens + rows, rows, att)
    assert ctrl.last_plan.cost == pytest.approx(cost.cost(shape), rel=1e-9)


def test_learned_costs_switch_speculation_off():
    """The prior (the runner alone) says a row adds 1 % to a batch-8 step; the engine's measured
    steps (of assorted batches and draft counts) say 7.7 % (1 ms on 13 ms), so a draft must
    return > 0.615 tokens. After the evidence, the controller stops drafting for requests that
    accept 40 % (the fit keeps a little of the prior: not 50 %, at the margin)."""
    prior = synthetic_model(step=1e-2, per_logit_row=1e-4)
    truth = synthetic_model(step=5e-3, per_logit_row=1e-3)
    ctrl = _ctrl(prior, max_k=4, prior_alpha=7.0, prior_beta=3.0, probe_interval=0)
    reqs = _reqs(8)
    ctrl.acceptance.global_succ[:] = [0.4e9] * 4
    ctrl.acceptance.global_trials[:] = [1e9] * 4
    assert sum(ctrl.choose(reqs)) > 0
    rng = random.Random(3)
    for _ in range(200):
        b = rng.randint(1, 16)
        rows = b * (1 + rng.randint(0, 4))
        shape = StepShape(b, rows, rows, 0.0)
        ctrl.observe_step(shape, truth.cost(shape))
    assert sum(ctrl.choose(reqs)) == 0


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
    assert ctrl.acceptance.global_probs() == pytest.approx(true, abs=0.15)


@pytest.mark.parametrize("seed", range(8))
def test_stopped_request_resumes_when_acceptance_improves(seed):
    """Bounds derived, not fit to one trajectory (checked over seeds): while acceptance is 0.05 a
    draft does not pay, so only probes draft (k = 1, at most one per ``probe_interval`` steps);
    once it is 0.95, k is the optimum ``optimal_draft_lengths`` gives at the true rates."""
    rng = random.Random(seed)
    cost = synthetic_model(step=0.7, per_logit_row=0.3)       # a draft pays iff its m > 0.3
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
    curve, rc = ctrl.step_costs(reqs)

    def optimum(rate: float) -> int:
        return optimal_draft_lengths([[rate] * 4], [4], curve, rc)[0][0]
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
    g = ctrl.acceptance.global_probs()
    assert ctrl.estimate("x") == pytest.approx(g)
    ctrl.observe("y", 1, 1)                  # reuses the freed row, starting clean
    assert ctrl.estimate("y")[1] == pytest.approx(ctrl.acceptance.global_probs()[1])
    ctrl.forget("never-seen")                # no error


def test_estimator_growth_and_validation():
    est = AcceptanceEstimator(3)
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
    assert est.global_trials == [2, 2, 1, 1]
    assert est.global_succ == [2, 1, 1, 0]


def test_untested_positions_inherit_the_deepest_measured_rate():
    est = AcceptanceEstimator(4, prior_alpha=1.0, prior_beta=1.0, decay=1.0)
    for _ in range(1000):
        est.observe("r", 1, 1)               # only position 0 ever tested, always accepted
    g = est.global_probs()
    assert g[0] > 0.99 and g[3] == pytest.approx(g[0])
    assert est.estimate("r")[3] == pytest.approx(g[3])


def test_from_config_and_histogram():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens="auto")
    ctrl = AdaptiveSpecController.from_config(cfg, FLAT, prior_alpha=9.0)
    assert ctrl.max_k == cfg.max_spec_tokens
    assert ctrl.choose([]) == []
    ctrl.choose(_reqs(3))
    assert ctrl.k_histogram == {cfg.max_spec_tokens: 3}
    n = ctrl.cost_model.num_updates
    ctrl.observe_step(StepShape(1, 10, 10, 0.1), 1.0)
    assert ctrl.cost_model.num_updates == n + 1


def test_acceptance_is_learnt_per_draft_kind():
    """Drafts of kind 4 (say, after a 4-token n-gram match) are always accepted, drafts of kind
    2 never, for the same request: with kinds the controller drafts deep for the one and not at
    all for the other; without them it averages the two into one middling k."""
    cost = synthetic_model(step=1.0, per_logit_row=0.3)       # a draft pays iff its m > 0.3
    ctrl = _ctrl(cost, probe_interval=0)
    (r,) = _reqs(1)
    for _ in range(200):
        ctrl.observe("r0", 4, 4, kind=4)
        ctrl.observe("r0", 4, 0, kind=2)
    assert ctrl.choose([r], kinds=[4]) == [4]
    assert ctrl.choose([r], kinds=[2]) == [0]
    assert ctrl.estimate("r0", 4)[0] > 0.95 and ctrl.estimate("r0", 2)[0] < 0.05
    assert set(ctrl.kinds) == {None, 2, 4} and ctrl.tracked_requests() == {"r0"}
    before = (ctrl.step, dict(ctrl.k_histogram), ctrl.estimate("r0", 4))
    for table in ctrl.tables:
        table.begin()
    ctrl.choose([r], kinds=["new"])                           # a failed step's new kind goes
    assert set(ctrl.kinds) == {None, 2, 4, "new"}
    for table in ctrl.tables:
        table.rollback()
    assert set(ctrl.kinds) == {None, 2, 4}
    assert (ctrl.step, dict(ctrl.k_histogram), ctrl.estimate("r0", 4)) == before
    ctrl.forget("r0")
    assert not ctrl.tracked_requests()
    with pytest.raises(ValueError):
        ctrl.choose([r], kinds=[1, 2])


def test_a_model_drafters_own_cost_is_learnt_and_priced():
    """The engine's start-up prior knows nothing of drafting; steps where a model drafter ran for
    r requests (``StepShape.draft_requests``) cost 0.3 each more, and each draft row 0.05. After
    those steps the controller prices a model-drafted request's drafts with those costs: at
    acceptance 0.5 they stop paying, while the same request's free drafts (n-gram, suffix) still
    do."""
    prior = synthetic_model(step=1.0, per_logit_row=0.1)
    truth = synthetic_model(step=1.0, per_logit_row=0.1, per_draft_request=0.3, per_draft_row=0.05)
    ctrl = _ctrl(prior, probe_interval=0)
    reqs = _reqs(2)
    assert all(ctrl.choose(reqs, model_drafted=[False, True]))      # the prior: drafting is free
    rng = random.Random(5)
    for _ in range(300):
        b = rng.randint(1, 4)
        k = rng.randint(0, 4)
        dr = rng.randint(0, b) if k else 0
        shape = StepShape(b, b * (1 + k), b * (1 + k), 0.0, dr, dr * k)
        ctrl.observe_step(shape, truth.cost(shape))
    per_request, per_row = ctrl.cost_model.drafter_weights
    assert (per_request, per_row) == pytest.approx(truth.drafter_weights, rel=0.05)  # ~(0.3, 0.05)
    ks = ctrl.choose(reqs, model_drafted=[False, True])
    assert ks[0] > 0 and ks[1] == 0
