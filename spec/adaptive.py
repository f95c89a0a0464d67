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
The point is the steps where speculation is off (open chat with a model drafter at batch 1,
where a full solve every step cost a few percent of the step: benches/RESULTS.md, "The
controller's own cost, draft kinds and a model drafter's cost").

What falls out: k = 0 for requests whose drafts do not pay (low m or long context); shorter k
as the batch grows (a draft must return more than the step's average cost per token, which
falls with B); k = 0 for everyone when no draft raises R (a compute-bound step where a verify row
costs more than it returns).

Sleeping. Most steps of open chat draft nothing, and deciding so still costs: the proposer
drafts at the cap for every request, then the choice (benches/RESULTS.md, "Figures behind
decisions in the source"). After Z steps in a row on which there were
drafts and none paid (k = 0 for everyone but probes; a step with no draft at all, no n-gram match
anywhere, neither counts nor breaks the run: it is cheap already, and in math or code at batch 1
the match that ends it is the draft that pays), the next min(Z // ``SLEEP_RAMP``, ``MAX_SLEEP``)
steps skip both (``asleep``):
a short run sleeps nothing, a long one 3 steps in 4, and a request resumes drafting at most
``MAX_SLEEP`` steps late. Sleeping s steps in s + 1 saves s / (s + 1) of the cost and delays
the way back by up to s steps: 3 keeps 3/4 of the saving of 7 in 8 at under half the delay
(measured on open chat and code edits: benches/RESULTS.md, "Figures behind decisions in the
source"). A request that was not in the last zero plan (a new one decoding)
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
estimator of its draft's kind: on code edits an n-gram draft after a 4-token match is accepted
at the first position about twice as often as one after a 2-token match (benches/RESULTS.md,
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

from collections.abc import Hashable, Sequence
from functools import cache
from typing import Any

from tokenbudget.request_table import EngineRecord, RequestTable
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.acceptance import AcceptanceEstimator, Evidence
from tokenbudget.spec.controller_state import ControllerState, Plan
from tokenbudget.spec.cost_model import StepCostModel
from tokenbudget.spec.draft_lengths import optimal_draft_lengths
from tokenbudget.spec.draft_pricing import add_probes, no_draft_cost, probs_by_estimator, step_costs
from tokenbudget.spec.step_shape import StepShape

_EMPTY = StepShape(0, 0, 0, 0.0)
HOLD_STEPS = 8  # longest run of steps an all-zero plan is repeated without solving (module docstring)
SLEEP_RAMP = 8  # steps of k = 0 for everyone per step of sleep (module docstring, "Sleeping")
MAX_SLEEP = 3   # most steps slept in a row (module docstring, "Sleeping")
MAX_PROBE_BACKOFF = 8  # most probe intervals a request waits after rejected probes (module docstring)


def _state_field(name: str) -> property:
    return property(lambda self: getattr(self._state.value, name), doc=f"``ControllerState.{name}``")


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
        self.cost_model = cost_model
        self.probe_interval = int(probe_interval)
        self._state = EngineRecord("controller", ControllerState())
        # One estimator per draft kind (``spec.proposer``), each with its own engine-wide prior,
        # all over one pair of records (``spec.acceptance``); kind None (drafters without kinds)
        # is ``acceptance``. The estimators hold no state of their own (``_views`` only saves
        # making them again); the kinds seen are the keys of ``globals``.
        self.evidence: RequestTable[dict] = RequestTable("acceptance evidence")
        self.globals: EngineRecord[dict] = EngineRecord("acceptance", {})
        self._estimator_args = dict(prior_alpha=prior_alpha, prior_beta=prior_beta,
                                    prior_strength=prior_strength, decay=decay, global_decay=global_decay,
                                    evidence=self.evidence, globals_=self.globals, clock=lambda: self._state.value.step)
        self._views: dict[Hashable, AcceptanceEstimator] = {}
        self.acceptance = self.estimator(None)

    @property
    def tables(self) -> tuple[RequestTable, ...]:
        """The controller's records, for the engine core's step journal."""
        return self.evidence, self.globals, self._state

    step = _state_field("step")
    k_histogram = _state_field("k_histogram")
    num_probes = _state_field("num_probes")
    num_slept = _state_field("num_slept")
    last_plan = _state_field("last_plan")

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
        """g(D) and c_{i,j} for these decoding requests on top of ``base`` (``spec.draft_pricing``)."""
        return step_costs(self.cost_model, self.max_k, requests, base, max_drafts, model_drafted)

    def estimator(self, kind: Hashable = None) -> AcceptanceEstimator:
        """The acceptance estimator of drafts of ``kind`` (created at the prior on first use)."""
        est = self._views.get(kind)
        if est is None or kind not in self.globals.value:  # made, then rolled back: at the prior again
            est = self._views[kind] = AcceptanceEstimator(self.max_k, kind=kind, **self._estimator_args)
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
        st = self._state.edit()
        if sum(k) > st.last_plan.num_probes:     # drafts that pay (a probe alone does not wake)
            st.zero_streak = st.sleep = 0
        elif any(cap):                           # there were drafts, and none paid
            st.zero_streak += 1
            st.sleep = min(st.zero_streak // SLEEP_RAMP, MAX_SLEEP)
            st.sleep_ids = frozenset(r.request_id for r in requests)
        return k

    def asleep(self, requests: Sequence[Request]) -> bool:
        """Whether this step skips drafting and choosing altogether (module docstring,
        "Sleeping"); if so, it counts as a step with k = 0 for these requests. Call instead of
        ``choose``, before drafting."""
        st = self._state.value
        if not st.sleep or not st.sleep_ids.issuperset(r.request_id for r in requests):
            if st.sleep:
                self._state.edit().sleep = 0
            return False
        st = self._state.edit()
        st.sleep -= 1
        st.zero_streak += 1
        st.num_slept += 1
        self._next_step()
        self._no_drafts(len(requests), st.last_plan.cost, st.last_plan.ratio)
        return True

    def _next_step(self) -> None:
        """A new engine step: the engine-wide evidence decays by it (the estimators' clock)."""
        st = self._state.edit()
        st.step += 1
        st.probed = frozenset()

    def _plan(self, requests: Sequence[Request], base: StepShape, cap: list[int],
              kinds: Sequence[Hashable] | None, model_drafted: Sequence[bool] | None) -> list[int]:
        """``choose``'s plan: k = 0 where nothing can be drafted, the held zero plan, or the solve."""
        b = len(requests)
        if not any(cap):   # nothing to draft (no n-gram match, every request capped at 0): no choice
            return self._no_drafts(b, 0.0, 0.0)
        st = self._state.edit()
        inputs = (tuple(r.request_id for r in requests), None if kinds is None else tuple(kinds),
                  None if model_drafted is None else tuple(model_drafted), base, st.num_verdicts,
                  self.cost_model.version)
        hold = st.hold
        if (hold is not None and hold[0] == inputs and st.step - hold[2] < HOLD_STEPS
                and all(c <= h for c, h in zip(cap, hold[1]))):
            return self._no_drafts(b, st.last_plan.cost, st.last_plan.ratio)
        ests, rows = self._evidence(requests, kinds)
        costs = cache(lambda: self.step_costs(requests, base, sum(cap), model_drafted))  # once, if asked
        g0 = None if model_drafted is not None and any(model_drafted) else no_draft_cost(
            self.cost_model, requests, base, cap, ests, rows)
        if g0 is not None:      # no first draft pays, so no draft does: k = 0 without solving
            k, num, den = [0] * b, float(b), g0
        else:
            g, row_costs = costs()
            k, num, den = optimal_draft_lengths(probs_by_estimator(ests, rows), cap, g, row_costs)
        probed, num, den = add_probes(k, cap, ests, rows, num, den, costs, st.step, self.probe_interval)
        st.num_probes += len(probed)
        st.probed = frozenset(requests[i].request_id for i in probed)
        st.last_plan = Plan(k, num, den, num / den, len(probed))
        st.hold = None if any(k) else (inputs, cap, st.step)
        hist = st.k_histogram
        for kv in k:
            hist[kv] = hist.get(kv, 0) + 1
        return k

    def _no_drafts(self, b: int, cost: float, ratio: float) -> list[int]:
        """A plan of k = 0 for all ``b`` requests, without solving."""
        st = self._state.edit()
        st.last_plan = Plan([0] * b, float(b), cost, ratio)
        if b:
            st.k_histogram[0] = st.k_histogram.get(0, 0) + b
        return st.last_plan.k

    def _evidence(self, requests: Sequence[Request], kinds: Sequence[Hashable] | None
                  ) -> tuple[list[AcceptanceEstimator], list[Evidence]]:
        """Per request: the estimator of its draft's kind and its evidence there."""
        step = self.step
        if kinds is None:
            est = self.acceptance
            return [est] * len(requests), est.rows([r.request_id for r in requests], step)
        ests = [self.estimator(kd) for kd in kinds]
        return ests, [est.row(r.request_id, step) for est, r in zip(ests, requests)]

    # ---- feedback ----
    def observe(self, request_id: str, num_draft: int, num_accepted: int, kind: Hashable = None) -> None:
        """After the commit: the request verified ``num_draft`` drafts of ``kind``, kept
        ``num_accepted`` (a probe's verdict also sets its backoff, module docstring)."""
        est = self.estimator(kind)
        st = self._state.edit()
        est.observe(request_id, num_draft, num_accepted, st.step)
        st.num_verdicts += 1
        if request_id in st.probed and num_draft:
            e = est.row(request_id, st.step)
            est.set_probe_backoff(request_id, 1 if num_accepted else min(2 * e.probe_backoff, MAX_PROBE_BACKOFF))

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """The engine's measured step: it carried ``shape`` and took ``seconds``."""
        self.cost_model.update(shape, seconds)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted; free its state (every kind's)."""
        self.evidence.drop(request_id)

    def estimate(self, request_id: str, kind: Hashable = None) -> list[float]:
        """Current per-position conditional acceptance estimate of ``request_id``'s drafts of
        ``kind``."""
        return self.estimator(kind).estimate(request_id)

    @property
    def kinds(self) -> list[Hashable]:
        """The draft kinds seen so far (None first: drafters without kinds)."""
        return list(self.globals.value)

    def tracked_requests(self) -> set[str]:
        """Request ids with evidence in any kind (tests: released on the one release path)."""
        return set(self.evidence)
