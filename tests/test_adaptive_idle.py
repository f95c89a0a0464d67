"""The controller where no draft pays: what deciding so costs, and how drafting resumes.

Holding a zero plan while its inputs stand still, the first-draft test that skips the solve,
sleeping after long runs of zero plans, and the backoff of rejected probes (``spec.adaptive``'s
docstring). Each must leave the plan the exact optimiser would choose, or delay it by a bounded
number of steps.
"""

from __future__ import annotations

from controller_helpers import controller as _ctrl
from controller_helpers import decoding_requests as _reqs
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.spec.cost_model import synthetic_model
from tokenbudget.spec.draft_lengths import optimal_draft_lengths
from tokenbudget.spec.step_shape import StepShape


def test_rejected_probes_back_off_and_an_accepted_probe_resets():
    """Each rejected probe doubles the request's wait (probe_interval x 2, 4, up to
    MAX_PROBE_BACKOFF); an accepted probe resets the wait, and accepted drafts resume drafting."""
    from tokenbudget.spec.adaptive import MAX_PROBE_BACKOFF
    ctrl = _ctrl(synthetic_model(step=0.7, per_logit_row=0.3))  # a draft pays iff its m > 0.3
    reqs = _reqs(1)
    probes, drafted = [], []
    for _ in range(500):
        n = ctrl.num_probes
        (k,) = ctrl.choose(reqs)
        if ctrl.num_probes > n:
            probes.append(ctrl.step)
        if k:
            drafted.append(ctrl.step)
        ctrl.observe("r0", k, k if ctrl.step > 300 else 0)   # every draft rejected until step 300
    before = [p for p in probes if p <= 300]
    gaps = [b - a for a, b in zip(before, before[1:])]
    interval = ctrl.probe_interval
    assert gaps == [interval * min(2 ** (i + 1), MAX_PROBE_BACKOFF) for i in range(len(gaps))]
    first_after = min(p for p in probes if p > 300)
    assert first_after - before[-1] == interval * MAX_PROBE_BACKOFF
    assert min(d for d in drafted if d > first_after) <= first_after + interval   # the wait was reset
    assert drafted[-50:] == list(range(451, 501))                                   # drafting again


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(0, 3000), st.floats(0.0, 2.0), st.floats(0.0, 1.0),
       st.floats(0.0, 1e-3), st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
       st.lists(st.tuples(st.floats(0.0, 20.0), st.floats(0.0, 20.0)), min_size=12, max_size=12))
def test_zero_plan_shortcut_agrees_with_the_solver(b, ctx, step, hinge, kkey, glob, evidence):
    """The first-draft test that skips the solve (free drafters) answers k = 0 for all exactly
    when the exact optimiser does, whatever the costs and the evidence."""
    cost = synthetic_model(step=step, per_logit_row=0.1, hinges=[hinge, hinge], per_kkey=kkey)
    ctrl = _ctrl(cost, probe_interval=0)
    reqs = _reqs(b, context=ctx)
    ctrl.acceptance.global_succ[:] = [g * 50 for g in glob]
    ctrl.acceptance.global_trials[:] = [50.0] * 4
    for r, (succ, fail) in zip(reqs, evidence):
        e = ctrl.acceptance.row(r.request_id)
        e.succ, e.trials = [succ] * 4, [succ + fail] * 4
    caps = [4] * b
    curve, rc = ctrl.step_costs(reqs, max_drafts=4 * b)
    want = optimal_draft_lengths(ctrl.acceptance.probs(ctrl.acceptance.rows([r.request_id for r in reqs])),
                                 caps, curve, rc)[0]
    assert (ctrl.choose(reqs, caps=caps) == [0] * b) == (want == [0] * b)


def test_sleeps_after_steps_without_drafts_and_a_new_request_wakes_it():
    """After Z steps in a row with drafts none of which pays, the controller sleeps
    min(Z // SLEEP_RAMP, MAX_SLEEP) steps (no drafting, no choice), so a long run of them is one
    choice in MAX_SLEEP + 1; a request that was not in the last plan, or a plan that drafts, wakes
    it; steps without any draft do not put it to sleep."""
    import tokenbudget.spec.adaptive as adaptive
    ctrl = _ctrl(synthetic_model(step=1.0, per_logit_row=0.5), probe_interval=0)
    reqs = _reqs(3)
    for r in reqs:
        for _ in range(50):
            ctrl.observe(r.request_id, 4, 0)              # drafts never accepted: k = 0 pays best
    pattern = ""
    for _ in range(120):
        if ctrl.asleep(reqs[:2]):
            pattern += "z"
        else:
            assert ctrl.choose(reqs[:2]) == [0, 0]
            pattern += "c"
    assert ctrl.step == 120 and ctrl.k_histogram[0] == 240
    assert pattern.startswith("c" * adaptive.SLEEP_RAMP + "zc")
    assert ("c" + "z" * adaptive.MAX_SLEEP) * 3 in pattern[-4 * (adaptive.MAX_SLEEP + 1):]
    ctrl.choose(reqs[:2])                                 # a zero plan after a long run: sleeps next
    assert ctrl.asleep(reqs[:1])                          # one of them finished: still asleep
    assert not ctrl.asleep(reqs)                          # a new request: awake, and chooses
    assert not ctrl.asleep(reqs[:2])
    for _ in range(60):
        ctrl.observe("r0", 1, 1)                          # r0's drafts now pay
    assert ctrl.choose(reqs[:2])[0] > 0 and not ctrl.asleep(reqs[:2])
    for _ in range(40):                                   # no draft at all (no match): never sleeps
        assert not ctrl.asleep(reqs[:2]) and ctrl.choose(reqs[:2], caps=[0, 0]) == [0, 0]


def test_all_zero_plans_are_held_until_something_moves(monkeypatch):
    """A plan of k = 0 for everyone is repeated without solving for up to HOLD_STEPS steps, and
    solved again at once when a verdict arrives, the requests, their kinds or the step's other
    work change, or a cap grows."""
    import tokenbudget.spec.adaptive as adaptive
    calls = []
    ctrl = _ctrl(synthetic_model(step=1.0, per_logit_row=0.5), probe_interval=0)
    real = ctrl._evidence   # read on every decision that is not held
    monkeypatch.setattr(ctrl, "_evidence", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    reqs = _reqs(2)
    for r in reqs:
        for _ in range(50):
            ctrl.observe(r.request_id, 4, 0)              # drafts never accepted: k = 0 pays best
    for _ in range(20):
        assert ctrl.choose(reqs) == [0, 0]
    assert len(calls) == -(-20 // adaptive.HOLD_STEPS)   # solved on steps 1, 9 and 17
    ctrl.observe("r0", 1, 0)
    ctrl.choose(reqs)
    assert len(calls) == 4                                # a verdict
    ctrl.choose(reqs, caps=[2, 2])
    assert len(calls) == 4                                # smaller caps: still held
    ctrl.observe("r1", 1, 0)
    ctrl.choose(reqs, caps=[1, 1])
    ctrl.choose(reqs, caps=[2, 1])
    assert len(calls) == 6                                # a verdict, then a larger cap
    ctrl.choose(reqs[:1])
    assert len(calls) == 7                                # other requests
    ctrl.choose(reqs[:1], kinds=[3])
    assert len(calls) == 8                                # another kind
    ctrl.choose(reqs[:1], kinds=[3], base=StepShape(1, 30, 1, 0.0))
    assert len(calls) == 9                                # other work in the step
    ctrl.choose(reqs[:1])
    ctrl.choose(reqs[:1])
    assert len(calls) == 10                               # the first solve holds again
    monkeypatch.setattr(adaptive, "HOLD_STEPS", 0)        # no hold: every step solved
    ctrl.choose(reqs[:1])
    assert len(calls) == 11


def test_a_step_that_crosses_the_thread_team_is_priced_by_the_drop():
    """Below TEAM_ROWS the C kernels run one thread: rows there cost more, and a step of
    TEAM_ROWS rows can cost less than one of TEAM_ROWS - 2 (benches/RESULTS.md). At B = 4 one or
    two drafts each then do not pay and four each do; the first-draft test must not stop the
    solve there, and the plan is the solver's."""
    from tokenbudget.spec.step_shape import TEAM_ROWS
    cost = synthetic_model(step=4.0, per_logit_row=0.1, per_token_below_team=1.0)
    assert not cost.is_convex_above(4) and cost.is_convex_above(TEAM_ROWS)
    ctrl = _ctrl(cost, probe_interval=0, prior_alpha=1.0, prior_beta=1.0)
    reqs = _reqs(4)
    ctrl.acceptance.global_succ[:] = [30.0] * 4
    ctrl.acceptance.global_trials[:] = [100.0] * 4      # a = 0.3 at every position
    curve, rc = ctrl.step_costs(reqs, max_drafts=16)
    assert curve[4] < curve[2] and curve[1] > curve[0]      # the drop, and a first draft that costs
    want = optimal_draft_lengths(ctrl.acceptance.probs(ctrl.acceptance.rows([r.request_id for r in reqs])),
                                 [4] * 4, curve, rc)[0]
    got = ctrl.choose(reqs, caps=[4] * 4)
    assert got == want and sum(got) >= TEAM_ROWS - 4
