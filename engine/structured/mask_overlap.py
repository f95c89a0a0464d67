"""Grammar masks computed beside the forward pass (``MaskOverlap``).

A step's masks depend only on the grammar states and the step's drafts, both known once
``schedule()`` has run; the forward depends only on the batch. So they can run at the same time:
llguidance computes a mask with the GIL released, and the C kernels and torch run the forward
without it, so on two cores a structured step takes about max(forward, masks) instead of their
sum. The runner waits for the masks only where it applies them, after the forward
(``SchedulerOutput.grammar_masks``).

When: the masks go to the mask thread only when nothing is expected to go wrong with them: every
structured request of the step has an estimate of its mask cost (``GrammarMatcher.cost``), each
below half its per-request limit (``max_mask_ms``), and together within the step's budget
(``mask_budget``). A ``MaskDeferral`` or a cost fault would otherwise arrive after the forward
had run and cost that forward (the attempt rolls back and runs again), so the steps that
``mask_budget`` rations compute their masks before the forward, as they always did. A fault that
arrives anyway (a grammar stuck, an estimate that was wrong) fails the attempt after the forward
like any late fault: rolled back, and the request ends alone.

The invariant the step relies on: the core waits for the mask thread before the attempt ends,
passed or failed, so whenever any other code of the step touches a matcher (``prepare``,
``rollback``, ``commit``), the mask thread is not.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait

from tokenbudget.scheduler.output import SchedulerOutput


class MaskOverlap:
    """Starts a step's masks (``start``) and waits for them (``wait``); one thread, made on first use."""

    def __init__(self, structured) -> None:
        self.structured = structured
        self._pool: ThreadPoolExecutor | None = None
        self.steps_beside = 0  # steps whose masks ran beside the forward (tests and benches read it)

    def start(self, sched: SchedulerOutput) -> None:
        """Set ``sched.grammar_bitmask``: the masks, or a ``Future`` of them computed beside the
        forward (see the module docstring for when). Raises what ``grammar_bitmask`` raises when
        they are computed now."""
        structured = self.structured
        if not structured.matchers or not self._fits(sched):
            sched.grammar_bitmask = structured.grammar_bitmask(sched)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenbudget-masks")
        self.steps_beside += 1
        sched.grammar_bitmask = self._pool.submit(structured.grammar_bitmask, sched)

    def wait(self, sched: SchedulerOutput | None) -> None:
        """Until the step's mask thread is done (its outcome stays in the future, unraised)."""
        if sched is not None and isinstance(sched.grammar_bitmask, Future):
            wait([sched.grammar_bitmask])

    def _fits(self, sched: SchedulerOutput) -> bool:
        structured = self.structured
        total, half_limit = 0.0, structured.max_mask_seconds / 2
        for sr in sched.scheduled:
            matcher = structured.matchers.get(sr.request_id)
            if matcher is None or not sr.needs_sample:
                continue
            if not 0 < matcher.cost <= half_limit:
                return False
            total += matcher.cost  # the last step's masks of all its rows, older ones halving
        return total <= structured.budget.seconds
