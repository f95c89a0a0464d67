"""Start-up measurement of the target's step cost c(T) for the adaptive draft-length controller.

Runs the real runner (forward + logits) on a throw-away request of T tokens whose every row
needs logits (the shape of a decode/verify batch, where each token is sampled or verified), over
a small grid of T. Block ids 0.. are written with garbage KV: at start-up no request holds them,
and every slot is written before it is read later. The grid stops at 256 tokens to keep start-up
short; above it the cost model extrapolates, and online updates from real steps refine it.
"""

from __future__ import annotations

import torch

from scheduler.config import SchedulerConfig
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request
from spec.cost_model import StepCostModel, default_grid, measure_step_costs


def _dummy_step(num_tokens: int, block_size: int) -> SchedulerOutput:
    tokens = [0] * num_tokens
    request = Request("__cost_probe__", tokens[:1])
    blocks = list(range(-(-num_tokens // block_size)))
    sr = ScheduledRequest(request, 0, num_tokens, tokens, tokens[1:], blocks, True, True)
    return SchedulerOutput([sr], num_tokens)


def measure_runner_costs(runner, sched_config: SchedulerConfig, max_tokens: int = 256) -> StepCostModel:
    limit = min(max_tokens, sched_config.max_num_batched_tokens,
                sched_config.num_blocks * sched_config.block_size)
    steps = {t: _dummy_step(t, sched_config.block_size) for t in default_grid(limit)}

    def run(t: int) -> None:
        with torch.inference_mode():
            runner.compute_logits(steps[t])
        if runner.device.type == "cuda":
            torch.cuda.synchronize()

    # scale_ewma (spec.cost_model) stays off: on benches/adaptive.py it was not shown to help
    # (one noisy run), and at large batches it spreads per-request costs into every bucket.
    return measure_step_costs(run, sorted(steps), warmup=1, repeats=2)
