"""What one engine step carries, as the step cost model's features (``spec.cost_model``).

``StepShape`` is built from a ``SchedulerOutput`` by ``step_shape``, or by the draft-length
controller for a step it is about to choose drafts for (``spec.draft_pricing``):

* ``requests``: requests in the step (per-request work: row preparation, attention setup);
* ``tokens``: rows of the forward (decode rows + verify rows + prefill chunk tokens);
* ``logit_rows``: rows that need logits and sampling/verification (decode and verify rows, the
  last row of a prefill that completes);
* ``attention``: sum over rows of the keys each row attends, in thousands (a verify row of a
  request with a long context reads the whole context: this is why verifying drafts of a long
  QA-over-a-passage request costs more than drafts of a short chat);
* ``tokens`` over knots (``HINGE_KNOTS``): ``max(0, tokens - knot)``. With non-negative weights the
  cost is convex piecewise linear in the row count, which covers the memory-bound regime where
  the first few rows of a GEMM are almost free (the weights are streamed once either way) and
  each further row costs compute;
* ``tokens_below_team``: ``tokens`` while below ``TEAM_ROWS``, else 0. The C kernels run one
  thread below 8 rows and their whole team from there (``kernels/cpu/quant_gemm.h``), so at 2
  threads a step of 8 rows can cost less than one of 6 (benches/RESULTS.md, "Figures behind
  decisions in the source"): the rows below the team cost this much more each, and the curve
  drops at ``TEAM_ROWS``. Its weight is learnt like the others (~0 at one thread, on torch's kernels, on
  CUDA); with it g is not convex, which the optimiser handles (it scans the total draft count)
  and the controller's first-draft test checks (``is_convex_above``);
* ``draft_requests`` / ``draft_rows``: requests a model drafter (draft model, EAGLE-3 head) drafted
  for in this step, and the draft rows it ran for them. Drafting is part of the step's wall time,
  and a model drafter's cost is per drafted request (catching up on the positions committed
  since it last ran, dispatch of its small ops: on a CPU mostly Python) and per draft row, not
  per verify row, so it gets its own terms; free drafters (n-gram, suffix) leave them at 0. A
  long catch-up (a request back to drafting after a pause) is not priced on its own: it is paid
  once and buys every later step's drafts, which a per-step price would forbid for good (the
  longer the pause, the dearer the way back).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HINGE_KNOTS = (4, 16, 64, 256)
# Rows from which the C kernels run their whole thread team; below it, one thread
# (TEAM_MIN_ROWS in kernels/cpu/quant_gemm.h; a test keeps the two equal).
TEAM_ROWS = 8
FEATURES = ("step", "requests", "tokens", "logit_rows", "attention") + tuple(
    f"tokens_over_{k}" for k in HINGE_KNOTS) + ("draft_requests", "draft_rows", "tokens_below_team")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step carries (see the module docstring); attention in thousands of keys."""

    requests: int
    tokens: int
    logit_rows: int
    attention: float
    draft_requests: int = 0
    draft_rows: int = 0

    def phi(self) -> list[float]:
        """The feature vector (``FEATURES``), as floats."""
        t = self.tokens
        return ([1.0, float(self.requests), float(t), float(self.logit_rows), float(self.attention)]
                + [float(t - k) if t > k else 0.0 for k in HINGE_KNOTS]
                + [float(self.draft_requests), float(self.draft_rows), float(t) if t < TEAM_ROWS else 0.0])

    def features(self) -> np.ndarray:
        return np.array(self.phi())


def default_grid(max_tokens: int) -> list[int]:
    """Powers of two up to ``max_tokens``, plus ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    grid, t = [], 1
    while t < max_tokens:
        grid.append(t)
        t *= 2
    grid.append(max_tokens)
    return grid


def request_attention(context: int, rows: int) -> float:
    """Keys attended (thousands) by ``rows`` rows following ``context`` cached tokens: row j
    sees ``context + j + 1`` keys."""
    return (rows * context + rows * (rows + 1) / 2) / 1000.0


def step_shape(sched) -> StepShape:
    """The shape of a ``SchedulerOutput`` (``scheduler.output``)."""
    requests = tokens = logit_rows = 0
    attention = 0.0
    for sr in sched.scheduled:
        n = len(sr.token_ids)
        requests += 1
        tokens += n
        if sr.needs_sample:
            logit_rows += 1 + len(sr.spec_token_ids)
        attention += request_attention(sr.num_computed_tokens, n)
    return StepShape(requests, tokens, logit_rows, attention)
