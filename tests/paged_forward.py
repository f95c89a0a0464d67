"""The model's forward through a real paged KV cache, outside the engine (imported, not a
conftest): a runner with a greedy stand-in sampler, random non-contiguous block tables, and
prefills fed in random chunks with several requests per step."""

from __future__ import annotations

import random

import torch

from tokenbudget.engine.worker.kv_cache_alloc import allocate_kv_caches
from tokenbudget.engine.worker.model_runner import ModelRunner
from tokenbudget.scheduler.output import SchedulerOutput
from tokenbudget.scheduler.request import Request

from model_helpers import scheduled


class GreedyStandIn:
    """Greedy stand-in for the sampler (tests only): argmax of each request's last row."""

    def __call__(self, logits, rows):
        from tokenbudget.engine.worker.sampler import SamplerOutput
        out, r = [], 0
        for row in rows:
            k = row.num_drafts
            out.append([int(logits[r + k].argmax())])
            r += 1 + k
        return SamplerOutput(out)



def make_runner(model, cfg, num_blocks=64, block_size=4):
    caches = allocate_kv_caches(cfg, num_blocks, block_size, torch.float32, "cpu")
    return ModelRunner(model, cfg, caches, block_size, GreedyStandIn(), "cpu")


def random_tables(rng: random.Random, lens: list[int], num_blocks: int, block_size: int):
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, i = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(ids[i:i + nb])
        i += nb
    assert i <= num_blocks
    return tables


def chunked_logits(runner, prompts, tables, rng):
    """Feed every prompt in random chunks, all requests in the same steps; return per-request
    logits at every position ``[len, V]``."""
    reqs = [Request(f"r{i}", p, max_tokens=4) for i, p in enumerate(prompts)]
    done = [0] * len(prompts)
    got = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        sched, owners = SchedulerOutput(), []
        for i, (req, p) in enumerate(zip(reqs, prompts)):
            if done[i] >= len(p):
                continue
            n = min(len(p) - done[i], rng.randint(1, 9))
            sched.scheduled.append(scheduled(req, done[i], n, p[done[i]:done[i] + n], [], tables[i]))
            owners.append(i)
            done[i] += n
        ids, pos, md, _ = runner.prepare_inputs(sched)
        hidden = runner.model(ids, pos, md, runner.kv_caches)
        logits = runner.model.compute_logits(hidden)
        for b, i in enumerate(owners):
            got[i].append(logits[md.qo_indptr[b]:md.qo_indptr[b + 1]])
    return [torch.cat(g) for g in got]
