"""``MaskBudget``: the CPU time one step may spend on grammar masks, shared between the requests.

Each structured request's masks are bounded per step (``max_grammar_mask_ms``: past it that
request fails), but not their sum: 62 children of a costly regex (8 ms a mask each) once made
every step of the batch 0.5 s, and a neighbouring plain stream 100 times slower. So the step has
a budget for all of its masks together (``max_batch_grammar_mask_ms``), and the structured
requests share it as deficit round robin shares a link:

* every request has an estimate of its next mask's cost (``GrammarMatcher.cost``: the first
  mask's at admission, then each mask's, with older ones halving; a grammar that is sometimes
  costly keeps a high estimate);
* when the estimates of all structured requests fit the budget, all run (the common case:
  an ordinary JSON schema costs tens of microseconds a mask);
* otherwise each gains an equal share of the budget as credit (capped at its estimate), and the
  step takes the requests whose credit covers their estimate, longest waiting first, while their
  estimates fit (one whose estimate alone is past the budget runs alone); the others wait (they
  are left out of the step, and lose nothing). A request pays for what its masks took. So the
  masks take the budget per step on average, a request whose masks cost k times the fair share
  runs about one step in k (the most expensive wait longest), and every request runs within a
  bounded number of steps. A step with only structured requests runs at least one of them (no
  one else is waiting for it to be short);
* the estimates can be wrong (a grammar whose masks grow): the manager stops computing masks
  once the step's budget is spent and raises ``MaskDeferral`` for the requests left; the core
  steps again without them, reusing the masks already made.

So the masks of one step take at most the budget plus one request's mask (itself at most
``max_grammar_mask_ms``), and the budget on average, whatever the batch holds.
"""

from __future__ import annotations

from collections.abc import Collection


class MaskDeferral(Exception):
    """The step's mask budget ran out: ``request_ids`` wait for a later step (not a fault)."""

    def __init__(self, request_ids: Collection[str]) -> None:
        super().__init__(f"{len(request_ids)} structured requests wait for the next step's grammar-mask budget")
        self.request_ids = frozenset(request_ids)


class MaskBudget:
    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"max_batch_grammar_mask_ms must be > 0, got {seconds * 1e3!r}")
        self.seconds = seconds
        self.credit: dict[str, float] = {}  # request id -> CPU seconds it may spend (only while they are short)
        self.last_run: dict[str, int] = {}  # request id -> the step it last ran in
        self.steps = 0

    def defer(self, estimates: dict[str, float], alone: bool = False) -> frozenset[str]:
        """Of the structured requests in flight (id -> estimated CPU seconds of its next masks),
        the ones that wait this step; ``alone``: no other request is in flight (one runs)."""
        self.steps += 1
        if sum(estimates.values()) <= self.seconds:
            for rid in estimates:  # no debts or savings carried across steps that are not short
                self.credit.pop(rid, None)
            return frozenset()
        share = self.seconds / len(estimates)
        credit = self.credit
        for rid, cost in estimates.items():
            credit[rid] = min(credit.get(rid, 0.0) + share, cost)
        order = sorted(estimates, key=lambda rid: (credit[rid] < estimates[rid], self.last_run.get(rid, 0)))
        run, spent = [], 0.0
        for rid in order:
            ready = credit[rid] >= estimates[rid]
            if (ready and (not run or spent + estimates[rid] <= self.seconds)) or (alone and not run):
                run.append(rid)
                spent += estimates[rid]
                self.last_run[rid] = self.steps
        return frozenset(estimates).difference(run)

    def charge(self, request_id: str, seconds: float) -> None:
        """``request_id``'s masks took ``seconds`` of CPU in this step."""
        if request_id in self.credit:
            self.credit[request_id] = max(self.credit[request_id] - seconds, -self.seconds)
        self.last_run[request_id] = self.steps

    def forget(self, request_id: str) -> None:
        self.credit.pop(request_id, None)
        self.last_run.pop(request_id, None)
