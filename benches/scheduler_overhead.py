"""Scheduler overhead: microseconds per step of the scheduler's part of a step transaction.

``begin_step() + schedule()`` (timed as *schedule*) and ``plan_update() + apply_update()`` (timed as
*update*), the calls ``EngineCore.step`` makes (the journal that makes a step undoable included).

Steady-state decode of N running requests (prompts of 100-500 tokens, already prefilled before
timing; ignore_eos, long max_tokens), prefix caching on, block size 16, with no drafts and with
k drafts per request whose acceptance is random (uniform 0..k). The fake model is not timed:
its output (accepted drafts + one token) is built between the two timed calls from precomputed
random numbers, without hashing. ``add_drafts`` (setting the step's drafts) is timed separately
and reported in its own column; it is not part of the headline number.
The default clock is the thread's CPU time (`time.thread_time`): on a shared 2-core machine under
load, wall time mostly measures the neighbours; `--clock wall` gives perf_counter.

    python benches/scheduler_overhead.py [--requests 16 64 256 1024] [--drafts 0 4]
                                         [--steps 200] [--json PATH] [--profile]

Reference point (from the brief, not measured here): vLLM 0.33's scheduler with a fake model
and prefix caching on, on this kind of machine: 2.8 ms/step at 256 requests without drafts,
4.5 ms/step with 4 drafts (11 / 18 us per request).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.drafts import DraftBatch  # noqa: E402
from tokenbudget.scheduler.output import ModelRunnerOutput  # noqa: E402
from tokenbudget.scheduler.request import Request  # noqa: E402
from tokenbudget.scheduler.scheduler import Scheduler  # noqa: E402

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192


def _fake_output(sched_out, accept: list[int], tokens: list[int], cursor: int) -> tuple[ModelRunnerOutput, int]:
    """Accepted drafts (a random count) + one new token per sampling request; [] for partial chunks."""
    req_ids, sampled = [], []
    n_acc, n_tok = len(accept), len(tokens)
    for sr in sched_out.scheduled:
        req_ids.append(sr.request_id)
        if not sr.needs_sample:
            sampled.append([])
            continue
        spec = sr.spec_token_ids
        a = accept[cursor % n_acc] % (len(spec) + 1) if spec else 0
        sampled.append(spec[:a] + [tokens[cursor % n_tok]])
        cursor += 1
    return ModelRunnerOutput(req_ids, sampled), cursor


def build(num_requests: int, num_drafts: int, steps: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randint(100, 500))] for _ in range(num_requests)]
    # Every request keeps growing by up to 1 + k tokens per step; size the pool so nothing preempts.
    longest = 500 + (steps + 64) * (num_drafts + 1) + 2 * BLOCK_SIZE
    config = SchedulerConfig(max_num_batched_tokens=max(8192, num_requests * (num_drafts + 1)),
                             max_num_seqs=num_requests, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                             num_blocks=num_requests * (-(-longest // BLOCK_SIZE)) + 16,
                             enable_prefix_caching=True)
    sched = Scheduler(config)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"req-{i}", prompt, max_tokens=MAX_MODEL_LEN - len(prompt), ignore_eos=True,
                                  eos_token_id=2))
    return sched, rng


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def measure(num_requests: int, num_drafts: int, steps: int, warmup: int = 20, seed: int = 0,
            clock: str = "cpu") -> dict:
    sched, rng = build(num_requests, num_drafts, steps + warmup, seed)
    accept = [rng.randrange(num_drafts + 1) for _ in range(4099)]
    tokens = [rng.randrange(3, 32000) for _ in range(4093)]
    draft_pool = [rng.randrange(3, 32000) for _ in range(4091)]
    cursor = 0
    # Prefill (untimed) until every request is decoding.
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running) or len(sched.waiting):
        sched.begin_step()
        out = sched.schedule()
        result, cursor = _fake_output(out, accept, tokens, cursor)
        sched.apply_update(out, sched.plan_update(out, result))
    assert len(sched.running) == num_requests
    t_sched = t_update = t_drafts = 0.0
    scheduled_tokens = 0
    perf = CLOCKS[clock]
    gc.collect()
    for step in range(warmup + steps):
        if num_drafts:  # the proposer's output, built untimed
            drafts = DraftBatch([r.request_id for r in sched.running],
                                [draft_pool[(step * 7 + i) % 4000:(step * 7 + i) % 4000 + num_drafts]
                                 for i in range(len(sched.running))])
        t0 = perf()
        sched.begin_step()
        if num_drafts:
            d1 = perf()
            sched.add_drafts(drafts)
            d2 = perf()
            t0 += d2 - d1
        out = sched.schedule()
        t1 = perf()
        result, cursor = _fake_output(out, accept, tokens, cursor)
        t2 = perf()
        sched.apply_update(out, sched.plan_update(out, result))
        t3 = perf()
        if step >= warmup:
            t_sched += t1 - t0
            t_update += t3 - t2
            if num_drafts:
                t_drafts += d2 - d1
            scheduled_tokens += out.total_num_scheduled_tokens
    assert len(sched.running) == num_requests and sched.num_preemptions == 0
    per_step = (t_sched + t_update) / steps * 1e6
    return {"requests": num_requests, "drafts": num_drafts, "steps": steps,
            "us_per_step": round(per_step, 1), "us_per_request": round(per_step / num_requests, 2),
            "schedule_us": round(t_sched / steps * 1e6, 1), "update_us": round(t_update / steps * 1e6, 1),
            "set_drafts_us": round(t_drafts / steps * 1e6, 1),
            "tokens_per_step": round(scheduled_tokens / steps, 1)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--drafts", type=int, nargs="+", default=[0, 4])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs per row")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: this thread's CPU time (robust on a shared, loaded machine); wall: perf_counter")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--profile", action="store_true", help="cProfile one 256-request, 4-draft run")
    args = p.parse_args(argv)
    if args.profile:
        import cProfile
        import pstats
        cProfile.runctx("measure(256, 4, args.steps)", globals(), {"measure": measure, "args": args}, "/tmp/sched.prof")
        pstats.Stats("/tmp/sched.prof").sort_stats("tottime").print_stats(20)
        return 0
    rows = []
    print("scheduler overhead (begin_step + schedule + plan_update + apply_update), "
          f"{args.clock} clock, {args.steps} steps, best of {args.repeats}, "
          f"python {platform.python_version()}, {cpu_model()}")
    print(f"{'requests':>8} {'drafts':>6} {'us/step':>9} {'us/request':>10} {'schedule':>9} {'update':>8} "
          f"{'set_drafts':>10} {'tok/step':>8}")
    for n in args.requests:
        for k in args.drafts:
            row = min((measure(n, k, args.steps, seed=r, clock=args.clock) for r in range(args.repeats)),
                      key=lambda r: r["us_per_step"])
            rows.append(row)
            print(f"{n:>8} {k:>6} {row['us_per_step']:>9.1f} {row['us_per_request']:>10.2f} {row['schedule_us']:>9.1f} "
                  f"{row['update_us']:>8.1f} {row['set_drafts_us']:>10.1f} {row['tokens_per_step']:>8.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "scheduler_overhead", "cpu": cpu_model(), "clock": args.clock,
                                         "steps": args.steps, "repeats": args.repeats,
                                         "python": platform.python_version(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
