"""Start-up measurement of the target's step cost c(T) for the adaptive draft-length controller.

Runs the real runner (forward + logits) on a throw-away request of T tokens whose every row
needs logits (the shape of a decode/verify batch, where each token is sampled or verified), over
a small grid of T. Block ids 0.. are written with garbage KV: at start-up no request holds them,
and every slot is written before it is read later. The grid stops at 256 tokens to keep start-up
short; above it the cost model extrapolates, and online updates from real steps refine it.

Then a few decode-shaped steps of B requests of one token each (B in {1, 4, 16}, capped by
``max_num_seqs`` and the KV pool; each request has its own block and a context of one block)
seed the model's per-request term (``StepCostModel.fit_per_request``): on the torch attention
backend every request adds fixed overhead, so real multi-request steps cost more than the
single-request probe at the same T.
"""

from __future__ import annotations

import statistics
import time

import torch

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.output import ScheduledRequest, SchedulerOutput
from tokenbudget.spec.cost_model import StepCostModel, default_grid, measure_step_costs


def _dummy_step(num_tokens: int, block_size: int) -> SchedulerOutput:
    tokens = [0] * num_tokens
    blocks = list(range(-(-num_tokens // block_size)))
    sr = ScheduledRequest(request_id="__cost_probe__", num_computed_tokens=0, token_ids=tokens,
                          spec_token_ids=tokens[1:], block_ids=blocks, is_new=True, needs_sample=True)
    return SchedulerOutput([sr], num_tokens)


def _dummy_decode_step(num_requests: int, block_size: int) -> SchedulerOutput:
    """``num_requests`` requests decoding one token each after a context of ``block_size - 1``
    tokens, each in its own block (ids 0..num_requests-1)."""
    ctx = max(block_size - 1, 0)
    srs = []
    for i in range(num_requests):
        srs.append(ScheduledRequest(request_id=f"__cost_probe_{i}__", num_computed_tokens=ctx, token_ids=[0],
                                    spec_token_ids=[], block_ids=[i], is_new=True, needs_sample=True))
    return SchedulerOutput(srs, num_requests)


def _median_time(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_runner_costs(runner, sched_config: SchedulerConfig, max_tokens: int = 256) -> StepCostModel:
    limit = min(max_tokens, sched_config.max_num_batched_tokens,
                sched_config.num_blocks * sched_config.block_size)
    steps = {t: _dummy_step(t, sched_config.block_size) for t in default_grid(limit)}

    def run_step(step: SchedulerOutput) -> None:
        with torch.inference_mode():
            runner.compute_logits(step)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()

    # scale_ewma (spec.cost_model) stays off: on benches/adaptive.py it was not shown to help
    # (one noisy run), and at large batches it spreads per-request costs into every bucket.
    model = measure_step_costs(lambda t: run_step(steps[t]), sorted(steps), warmup=1, repeats=2)

    max_b = min(getattr(sched_config, "max_num_seqs", 16), sched_config.num_blocks, limit)
    sizes = sorted({b for b in (1, 4, 16) if b <= max_b})
    if len(sizes) > 1:
        measured = []
        for b in sizes:
            step = _dummy_decode_step(b, sched_config.block_size)
            measured.append((b, b, _median_time(lambda: run_step(step), warmup=1, repeats=3)))
        model.fit_per_request(measured)
    return model
