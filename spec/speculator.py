"""Glue between a proposer, the draft-length controller and the engine step.

At the start of each step (``propose``) the decoding requests whose ``max_spec_tokens`` allows
it get up to k drafts, where k is the configured ``num_speculative_tokens`` or, with ``"auto"``,
the adaptive controller's choice (nothing is drafted on a step the controller sleeps through,
``AdaptiveSpecController.asleep``); they go to the scheduler in one ``DraftBatch`` (with a model
drafter's probabilities), which cuts them to ``draft_limit``. When the step commits
(``commit``), the verified counts feed the metrics and the controller.

With the controller and a free drafter (n-gram, suffix) the order is draft-then-choose: drafts
at the cap (``draft_limit``), the controller's caps become the drafts' lengths, and the chosen
k_i truncate them. Planning with drafts that do not exist (no n-gram match: most steps of open
chat) would charge the step for tokens it never runs and make the controller too timid for
the requests that do have drafts. Model drafters keep choose-then-draft (drafting costs).
EAGLE-3 with suffix decoding (``enable_suffix_decoding``) does both: the proposer's
``free_drafts`` (suffix drafts, where long) go draft-then-choose, the other requests
choose-then-draft with the head. The controller learns acceptance per draft kind
(``spec.proposer``): a free drafter's kinds (the match length), and for the hybrid the suffix
drafts' kinds apart from the head's (``HEAD_KIND``), so a head that misses on copied code does
not make the controller cut the suffix drafts that hit, nor the reverse.

Transactions: the proposer's and the controller's state lives in their ``tables`` (journaled
by the engine core with every other component's), so a failed step needs nothing from here. What
one attempt noted for its commit (the drafts' kinds, the drafter's work, the proposals' receipts)
is set afresh at the start of every ``propose``. ``commit`` feeds the committed step to the
metrics, the controller and the proposer (``Proposer.on_commit``).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import replace
from typing import Any

from tokenbudget.api.spec_config import SpeculativeConfig
from tokenbudget.scheduler.drafts import DraftBatch, draft_limit
from tokenbudget.scheduler.output import EngineCoreOutput, SchedulerOutput
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.metrics import SpecDecodingStats
from tokenbudget.spec.proposer import CommittedStep, Proposal
from tokenbudget.spec.step_shape import StepShape, request_attention, step_shape

HEAD_KIND = "head"  # the controller's kind for a model drafter's drafts beside free ones (hybrid)


class Speculator:
    """With no config it is disabled: ``propose`` returns None and the rest does nothing."""

    def __init__(self, config: SpeculativeConfig | None = None, proposer=None, controller: Any = None) -> None:
        self.config = config
        self.proposer = proposer
        self.controller = controller
        self.max_k = config.max_spec_tokens if config is not None else 0
        # n-gram / suffix: drafting is cheap, deterministic and prefix-consistent (the drafts for
        # k are the first k of the drafts for a larger k), so with a controller the speculator
        # drafts at the cap first and lets the controller choose among real drafts.
        self._free_drafter = config is not None and config.method in ("ngram", "suffix")
        self._hybrid = config is not None and config.enable_suffix_decoding
        # This attempt's notes for its commit (set afresh by every ``propose``): the requests with
        # drafts and their drafts' kinds, the model drafter's work (requests, draft rows), receipts.
        self._drafted: tuple[list[str], list[Hashable]] = ([], [])
        self._drafter_work = (0, 0)
        self._receipts: list = []
        self.stats = SpecDecodingStats()

    @property
    def enabled(self) -> bool:
        return self.proposer is not None

    @property
    def tables(self) -> tuple:
        """The proposer's and the controller's records, for the engine core's step journal."""
        if self.proposer is None:
            return ()
        return tuple(self.proposer.tables) + (tuple(self.controller.tables) if self.controller is not None else ())

    # ---- the step
    def propose(self, scheduler, only: Collection[str] | None = None) -> DraftBatch | None:
        """Drafts for the next step's decoding requests (``only``: among these ids)."""
        if self.proposer is None:
            return None
        self._drafted, self._drafter_work, self._receipts = ([], []), (0, 0), []
        decoding = scheduler.decoding_requests(only)
        if not decoding or (self.controller is not None and self.controller.asleep(decoding)):
            return None
        max_model_len = scheduler.config.max_model_len
        drafted = free = kinds = None
        if self.controller is not None:
            caps = [draft_limit(r, max_model_len) for r in decoding]
            if self._free_drafter:
                # Cheap deterministic drafters: draft first, so the controller plans with the
                # drafts that exist (a request without a match costs nothing and gets k = 0).
                proposal = self._note(self.proposer.propose(decoding, caps))
                drafted, kinds = proposal.token_ids, proposal.kinds
                caps = [len(d) for d in drafted]
            elif self._hybrid:
                free = self._note(self.proposer.free_drafts(decoding, caps))  # [] where the head drafts
                caps = [c if not f else len(f) for f, c in zip(free.token_ids, caps)]
                kinds = [kd if f else HEAD_KIND for f, kd in zip(free.token_ids, free.kinds)]
            if self._free_drafter:
                model_drafted = None                          # drafts that cost nothing
            elif free is not None:
                model_drafted = [not f for f in free.token_ids]  # the head drafts where no free draft is
            else:
                model_drafted = [True] * len(decoding)
            ks = self.controller.choose(decoding, _base_shape(scheduler, decoding), caps, kinds, model_drafted)
            if kinds is not None:
                self._drafted = ([r.request_id for r, k in zip(decoding, ks) if k > 0],
                                 [kd for k, kd in zip(ks, kinds) if k > 0])
        else:
            ks = [draft_limit(r, max_model_len, self.max_k) for r in decoding]
        chosen = [(r, k) for r, k in zip(decoding, ks) if k > 0]
        if not chosen:
            return None
        if drafted is not None:
            tokens = [d[:k] for d, k in zip(drafted, ks) if k > 0]
            return DraftBatch([r.request_id for r, _ in chosen], tokens)
        if free is not None:
            return self._merge_free(decoding, ks, free)
        reqs = [r for r, _ in chosen]
        proposal = self._note(self.proposer.propose(reqs, [k for _, k in chosen]))
        self._drafter_work = _model_work(proposal)
        return DraftBatch([r.request_id for r in reqs], proposal.token_ids, proposal.probs)

    def _note(self, proposal: Proposal) -> Proposal:
        """Keep the proposal's receipt for the commit (``Proposer.on_commit``)."""
        if proposal.receipt is not None:
            self._receipts.append(proposal.receipt)
        return proposal

    def _merge_free(self, decoding, ks, free: Proposal) -> DraftBatch:
        """The chosen requests' drafts: free drafts cut to k, the others drafted by the model."""
        model = [(r, k) for r, k, f in zip(decoding, ks, free.token_ids) if k > 0 and not f]
        proposal = self._note(self.proposer.propose([r for r, _ in model], [k for _, k in model])) if model else None
        tokens = proposal.token_ids if proposal is not None else []
        if proposal is not None:
            self._drafter_work = _model_work(proposal)
            taken = {r.request_id: kind for (r, _), kind in zip(model, proposal.kinds or ()) if kind is not None}
            if taken:  # free drafts the drafter found at the smaller k: the controller learns them as theirs
                self._drafted = (self._drafted[0], [taken.get(rid, kd) for rid, kd in zip(*self._drafted)])
        probs = (proposal.probs if proposal is not None else None) or [None] * len(model)
        drafted = iter(zip(tokens, probs))
        ids, out, out_probs = [], [], []
        for r, k, f in zip(decoding, ks, free.token_ids):
            if k <= 0:
                continue
            t, q = (f[:k], None) if f else next(drafted)
            ids.append(r.request_id)
            out.append(t)
            out_probs.append(q)
        return DraftBatch(ids, out, out_probs if any(q is not None for q in out_probs) else None)

    def commit(self, plan: list[EngineCoreOutput], sched: SchedulerOutput | None = None,
               step_seconds: float | None = None, aux_hidden_states=None) -> None:
        """The step committed: record each request's verify; the step (``sched``) and its
        measured ``step_seconds`` (when known) teach the controller's cost model; the target's
        tap states of the step (``aux_hidden_states``, EAGLE-3) go to the proposer."""
        if self.proposer is None:
            return
        self.proposer.on_commit(CommittedStep(sched, plan, aux_hidden_states, self._receipts))
        stats, controller = self.stats, self.controller
        kinds = dict(zip(*self._drafted))
        for entry in plan:
            if entry.new_token_ids:
                stats.observe(entry.num_draft_tokens, entry.num_accepted_tokens)
                if controller is not None and entry.num_draft_tokens:
                    controller.observe(entry.request_id, entry.num_draft_tokens, entry.num_accepted_tokens,
                                       kinds.get(entry.request_id))
        if controller is not None and step_seconds is not None and sched is not None:
            shape = step_shape(sched)
            if self._drafter_work[0]:
                shape = replace(shape, draft_requests=self._drafter_work[0], draft_rows=self._drafter_work[1])
            controller.observe_step(shape, step_seconds)

    def on_finished(self, request: Request) -> None:
        """After the release of the request's records (the engine core's one release path)."""
        if self.proposer is not None:
            self.proposer.on_finished(request)


def _model_work(proposal: Proposal) -> tuple[int, int]:
    """(requests, draft rows) a model drafter ran for in ``proposal``: its non-empty drafts, not the
    free drafts it took instead (those have a kind: EAGLE-3 with suffix decoding takes a suffix
    draft long enough for the k it was asked, which may be shorter than the cap it was offered at)."""
    kinds = proposal.kinds or [None] * len(proposal.token_ids)
    own = [len(t) for t, kind in zip(proposal.token_ids, kinds) if t and kind is None]
    return len(own), sum(own)


def _base_shape(scheduler, decoding) -> StepShape:
    """What the next step runs besides the decoding requests' 1 + k rows: the prefill chunks of
    the other running requests, in order, within the token budget."""
    ids = {id(r) for r in decoding}
    budget = scheduler.config.max_num_batched_tokens - len(decoding)
    requests = tokens = logit_rows = 0
    attention = 0.0
    for r in scheduler.running:
        pending = r.num_tokens - r.num_computed_tokens
        if id(r) in ids or pending <= 0 or budget <= 0:
            continue
        n = min(pending, budget)
        budget -= n
        requests += 1
        tokens += n
        logit_rows += n == pending
        attention += request_attention(r.num_computed_tokens, n)
    return StepShape(requests, tokens, logit_rows, attention)
