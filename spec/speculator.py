"""Glue between a proposer and the engine loop: who gets drafts, how many, and the metrics.

Each step, after ``update_from_output``: the running requests whose committed tokens all have KV
but the last (i.e. decoding) and whose ``max_spec_tokens`` allows it get up to k drafts, where k
is the configured ``num_speculative_tokens`` or, with ``"auto"``, the adaptive controller's
choice. Drafter probabilities (draft model) go to the runner; drafts go to the scheduler, which
clips them to ``max_model_len`` and ``max_tokens``.

With the controller and a free drafter (n-gram, suffix) the order is draft-then-choose: drafts
at the cap (``draft_limit``), the controller's caps become the drafts' lengths, and the chosen
k_i truncate them. Planning with drafts that do not exist (no n-gram match: most steps of open
chat) would charge the step for tokens it never runs and make the controller too timid for
the requests that do have drafts. Model drafters keep choose-then-draft (drafting costs).
"""

from __future__ import annotations

from typing import Any

from tokenbudget.scheduler.output import EngineCoreOutput
from tokenbudget.spec.config import SpeculativeConfig
from tokenbudget.spec.metrics import SpecDecodingStats
from tokenbudget.spec.proposer import draft_limit


class Speculator:
    """With no config it is disabled: it only drains the scheduler's finished requests."""

    def __init__(self, config: SpeculativeConfig | None = None, proposer=None, controller: Any = None) -> None:
        self.config = config
        self.proposer = proposer
        self.controller = controller
        self.max_k = config.max_spec_tokens if config is not None else 0
        # n-gram / suffix: drafting is cheap, deterministic and prefix-consistent (the drafts for
        # k are the first k of the drafts for a larger k), so with a controller the speculator
        # drafts at the cap first and lets the controller choose among real drafts.
        self._free_drafter = config is not None and config.method in ("ngram", "suffix")
        self.stats = SpecDecodingStats()

    @property
    def enabled(self) -> bool:
        return self.proposer is not None

    def after_step(self, outputs: list[EngineCoreOutput], scheduler, runner) -> None:
        finished = scheduler.pop_finished_requests()
        if self.proposer is None:
            return
        self.observe(outputs)
        if self.controller is not None and getattr(runner, "last_step", None):
            self.controller.observe_step(*runner.last_step[:2],
                                         num_requests=self._step_requests(outputs, scheduler, runner))
        for request in finished:
            self.proposer.on_request_finished(request)
            if self.controller is not None:
                self.controller.forget(request.request_id)
        self.propose(scheduler, runner)

    def observe(self, outputs: list[EngineCoreOutput]) -> None:
        stats, controller = self.stats, self.controller
        for out in outputs:
            if out.num_draft_tokens:
                stats.observe(out.num_draft_tokens, out.num_accepted_tokens)
                if controller is not None:
                    controller.observe(out.request_id, out.num_draft_tokens, out.num_accepted_tokens)

    def propose(self, scheduler, runner) -> None:
        decoding = [r for r in scheduler.running
                    if r.num_computed_tokens == r.num_tokens - 1 and r.max_spec_tokens != 0]
        if not decoding:
            return
        drafted = None
        if self.controller is not None:
            max_model_len = scheduler.config.max_model_len
            caps = [draft_limit(r, max_model_len) for r in decoding]
            if self._free_drafter:
                # Cheap deterministic drafters: draft first, so the controller plans with the
                # drafts that exist (a request without a match costs nothing and gets k = 0).
                drafted = self.proposer.propose(decoding, caps)
                caps = [len(d) for d in drafted]
            base = min(self._base_tokens(scheduler, decoding), scheduler.config.max_num_batched_tokens)
            ks = self.controller.choose(decoding, base, caps,
                                        base_requests=self._base_requests(scheduler, decoding))
        else:
            ks = [self.max_k if r.max_spec_tokens is None else min(self.max_k, r.max_spec_tokens)
                  for r in decoding]
        num_zero = sum(1 for k in ks if k == 0)  # verified k > 0 are counted by observe()
        if num_zero:
            self.stats.k_histogram[0] = self.stats.k_histogram.get(0, 0) + num_zero
        chosen = [(r, k) for r, k in zip(decoding, ks) if k > 0]
        if not chosen:
            return
        reqs = [r for r, _ in chosen]
        if drafted is not None:
            drafts = [d[:k] for d, k in zip(drafted, ks) if k > 0]
            scheduler.update_draft_token_ids({r.request_id: d for r, d in zip(reqs, drafts) if d})
            return
        drafts = self.proposer.propose(reqs, [k for _, k in chosen])
        probs = self.proposer.take_draft_probs()
        if probs is not None:
            for r, p, d in zip(reqs, probs, drafts):
                if p is not None and d:
                    runner.set_draft_probs(r.request_id, p[:len(d)])
        scheduler.update_draft_token_ids({r.request_id: d for r, d in zip(reqs, drafts) if d})

    @staticmethod
    def _step_requests(outputs, scheduler, runner) -> int:
        """Requests in the step just run: the runner's figure if it reports one, else those
        that produced output (finished ones included) plus the running partial prefills (which
        produce none)."""
        last = runner.last_step
        if len(last) > 2 and last[2]:
            return int(last[2])
        partial = sum(1 for r in scheduler.running if r.num_computed_tokens < r.num_tokens - 1)
        return max(len(outputs) + partial, 1)

    @staticmethod
    def _base_requests(scheduler, decoding) -> int:
        """Requests the next step runs besides the decoding ones (prefills, non-speculating)."""
        ids = {id(r) for r in decoding}
        return sum(1 for r in scheduler.running
                   if id(r) not in ids and r.num_tokens - r.num_computed_tokens > 0)

    @staticmethod
    def _base_tokens(scheduler, decoding) -> int:
        """Tokens the next step runs besides the decoding requests' 1 + k (prefill chunks)."""
        return sum(r.num_tokens - r.num_computed_tokens for r in scheduler.running) - len(decoding)
