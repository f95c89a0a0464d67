"""Start-up prior of the step cost model (``spec.cost_model``) for the draft-length controller.

Times the real runner (forward + logits) on throw-away steps of chosen shapes, so every feature
of the model is excited once before the first real step: one request of T rows that all need
logits (T over a power-of-two grid: the decode/verify shape at batch 1, and the row curve's
bends), B one-row decode requests (per-request work), a decode and a verify after a long context
(attention), and prefill chunks without logits (rows vs logit rows). Block ids 0.. are written
with garbage KV: at start-up no request holds them, and every slot is written before it is read
later. The grid stops at 128 rows and the long context at 1024 tokens to keep start-up short
(under a second for the default model on one core, half of the old grid's to 256 rows with a
warm-up run per shape: benches/RESULTS.md, "Figures behind decisions in the source"; part of it
is first-call work the engine's own first steps would pay otherwise); online updates from real
steps take over from there.

Each step runs twice and the faster run counts: the first run of a new shape pays one-time work
(buffers of that row count), and the minimum of two also drops a neighbour's burst. The prior is
a start only (``prior_weight`` steps' worth in each direction), so two runs are enough.

The prior measures the runner, and a model drafter's drafts (``Proposer.probe_cost``: EAGLE-3's
head, a draft model) beside the verifies they feed; the engine's online updates time the whole
step (proposer, scheduler, sampler, outputs), so the model's level moves within a few dozen
steps. Without the drafter's probe the controller started out pricing the head's drafts at
nothing and drafted 3 tokens a step at low acceptance until the online fit caught up
(benches/RESULTS.md).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.output import ScheduledRequest, SchedulerOutput
from tokenbudget.spec.cost_model import StepCostModel
from tokenbudget.spec.step_shape import StepShape, default_grid, step_shape


def _request(i: int, context: int, rows: int, block_size: int, first_block: int,
             needs_sample: bool = True) -> ScheduledRequest:
    tokens = [0] * rows
    blocks = list(range(first_block, first_block + -(-(context + rows) // block_size)))
    spec = tokens[1:] if needs_sample else []
    return ScheduledRequest(request_id=f"__cost_probe_{i}__", num_computed_tokens=context, token_ids=tokens,
                            spec_token_ids=spec, block_ids=blocks, is_new=True, needs_sample=needs_sample)


def probe_steps(sched_config: SchedulerConfig, max_tokens: int = 128,
                max_context: int = 1024) -> list[SchedulerOutput]:
    """The start-up probe's steps, within the budget, the block pool and ``max_num_seqs``."""
    bs = sched_config.block_size
    slots = sched_config.num_blocks * bs
    limit = max(1, min(max_tokens, sched_config.max_num_batched_tokens, slots))
    steps = [SchedulerOutput([_request(0, 0, t, bs, 0)], t) for t in default_grid(limit)]
    max_b = min(sched_config.max_num_seqs, sched_config.num_blocks, limit)
    for b in sorted({b for b in (4, 16, 64) if b <= max_b}):
        srs = [_request(i, bs - 1, 1, bs, i) for i in range(b)]
        steps.append(SchedulerOutput(srs, b))
    ctx = min(max_context, slots - 16, sched_config.max_model_len - 16)
    if ctx >= 4 * bs:
        for rows in (1, min(5, limit)):
            steps.append(SchedulerOutput([_request(0, ctx, rows, bs, 0)], rows))
    for t in sorted({min(64, limit), limit}):
        if t > 1:
            steps.append(SchedulerOutput([_request(0, 0, t, bs, 0, needs_sample=False)], t))
    return steps


def _min_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


MAX_PROBE_DRAFTS = 8  # verify shapes up to this many drafts also get a drafted twin (drafter probes)


def measure_runner_costs(runner, sched_config: SchedulerConfig, max_tokens: int = 128, drafter=None,
                         **kwargs) -> StepCostModel:
    """A ``StepCostModel`` whose prior is this runner's time on ``probe_steps``. With a model
    ``drafter`` (``probe_cost`` not None, ``spec.proposer``), every one-request verify of k <=
    ``MAX_PROBE_DRAFTS`` drafts also counts as the step that drafted them: its time plus the
    drafter's for k tokens, timed right after the runner's step (so, as in the engine, after the
    target's forward has evicted the drafter from the caches)."""
    def run_step(step: SchedulerOutput) -> None:
        with torch.inference_mode():
            runner.compute_logits(step)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()

    def draft_after(step: SchedulerOutput, k: int) -> float:
        run_step(step)
        return drafter.probe_cost(k)

    if drafter is not None and drafter.probe_cost(1) is None:
        drafter = None  # drafts that cost nothing (n-gram, suffix): no drafted twins
    prior: list[tuple[StepShape, float]] = []
    for step in probe_steps(sched_config, max_tokens):
        seconds = _min_time(lambda: run_step(step), repeats=2)
        shape = step_shape(step)
        prior.append((shape, max(seconds, 1e-9)))
        k = len(step.scheduled[0].spec_token_ids) if len(step.scheduled) == 1 else 0
        if drafter is not None and 1 <= k <= MAX_PROBE_DRAFTS:
            cost = min(draft_after(step, k) for _ in range(2))
            prior.append((replace(shape, draft_requests=1, draft_rows=k), seconds + cost))
    return StepCostModel(prior, **kwargs)
