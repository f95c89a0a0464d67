"""Soak: thousands of requests through a deliberately small pool, with drafts, arriving over time.

All finish; none starves; every block is free afterwards; every output equals its solo reference.

Starvation bound (FCFS), derived rather than tuned: every running request is older than every
waiting one (admission is in arrival order, the preemption victim is the newest running request
and goes back to the head of the queue). So the oldest request in the system is ``running[0]``:
it is scheduled first each step with the whole budget, it is never the victim while another
request runs, and alone it always fits (admission validates that). It therefore commits at least
one position per step and finishes within ``len(prompt) + max_tokens`` steps of becoming the
oldest. Hence a request finishes within the summed lengths of the requests alive when it arrived
(itself included) -- the bound asserted below, next to the measured worst wait.
"""

from __future__ import annotations

import random
import time

import pytest

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.testing.fake_model import FakeModelSpec
from tokenbudget.testing.harness import Harness

NUM_REQUESTS = 3000
CONFIGS = {
    "prefix-cache": SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=96, block_size=4,
                                    num_blocks=64, enable_prefix_caching=True, policy="fcfs"),
    "lookahead+chunk-cap": SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=96,
                                           block_size=4, num_blocks=64, enable_prefix_caching=False,
                                           policy="fcfs", num_lookahead_tokens=3,
                                           long_prefill_token_threshold=16),
}
PREFIXES = [[], list(range(1, 17)), [9, 8, 7, 6, 5, 4, 3, 2] * 2]


def _workload(rng: random.Random):
    for i in range(NUM_REQUESTS):
        prompt = rng.choice(PREFIXES) + [rng.randrange(1, 64) for _ in range(rng.randint(1, 40))]
        yield f"s{i}", prompt, rng.randint(1, 40), rng.random() < 0.5


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_soak_small_pool_many_requests(name):
    rng = random.Random(1234)
    h = Harness(CONFIGS[name], FakeModelSpec(), seed=99, check=False)
    sched = h.scheduler
    workload = _workload(rng)
    arrived_at: dict[str, int] = {}
    bound: dict[str, int] = {}
    length: dict[str, int] = {}
    alive_work = 0
    finished_seen = 0
    worst_wait = 0
    worst_ratio = 0.0
    remaining = NUM_REQUESTS
    step = 0
    t0 = time.perf_counter()
    while remaining or sched.has_unfinished_requests():
        for _ in range(min(rng.choice([0, 0, 1, 1, 1, 2]), remaining)):  # ~0.83 arrivals per step
            rid, prompt, max_tokens, ignore_eos = next(workload)
            remaining -= 1
            h.add(h.make_request(rid, prompt, max_tokens=max_tokens, ignore_eos=ignore_eos))
            length[rid] = len(prompt) + max_tokens
            alive_work += length[rid]
            arrived_at[rid] = step
            bound[rid] = alive_work
        h.step(rng.choice([0, 1, 2, 4]), rng.choice([0.2, 0.6, 0.9]))
        step += 1
        finished = list(h.finished)
        for rid in finished[finished_seen:]:
            wait = step - arrived_at[rid]
            worst_wait = max(worst_wait, wait)
            worst_ratio = max(worst_ratio, wait / bound[rid])
            assert wait <= bound[rid], f"{rid} starved: finished {wait} steps after arrival, bound {bound[rid]}"
            alive_work -= length[rid]
        finished_seen = len(finished)
        if step % 50 == 0:
            sched.check_integrity()
        assert step < 200_000, "soak did not drain"
    elapsed = time.perf_counter() - t0
    sched.check_integrity()
    assert len(h.finished) == NUM_REQUESTS and all(why != "abort" for why in h.finished.values())
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "blocks leaked"
    h.check_lossless()
    assert sched.num_preemptions > 0, "the pool was not small enough to exercise preemption"
    print(f"\nsoak[{name}]: {NUM_REQUESTS} requests, {step} steps, {sched.num_preemptions} preemptions, "
          f"worst wait {worst_wait} steps, worst wait/bound {worst_ratio:.2f}, {elapsed:.1f}s")
