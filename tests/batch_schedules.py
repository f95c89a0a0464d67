"""The batch-invariance test kit (imported, not a conftest): a small random Llama config and
state dict, and ``run_schedule``, which runs sequences through a real ``ModelRunner`` under a
chosen chunking (``SCHEDULES``) and returns every position's logits."""

from __future__ import annotations

import random

import torch

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.worker.kv_cache_alloc import allocate_kv_caches
from tokenbudget.engine.worker.model_runner import ModelRunner
from tokenbudget.scheduler.output import SchedulerOutput
from tokenbudget.scheduler.request import Request

from model_helpers import scheduled

CFG = ModelConfig(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d = cfg.hidden_size, cfg.resolved_head_dim
    q, kv, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size

    def w(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": w(cfg.vocab_size, h, scale=1.0),
          "model.norm.weight": 1 + w(h, scale=0.1)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        sd |= {p + "input_layernorm.weight": 1 + w(h, scale=0.1),
               p + "post_attention_layernorm.weight": 1 + w(h, scale=0.1),
               p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
               p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
               p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
               p + "mlp.down_proj.weight": w(h, i)}
    return sd


def run_schedule(model, seqs, chunker, dtype, seed):
    """Run all sequences to completion, chunk sizes from ``chunker(rng, remaining)``; requests are
    batched together in each step (random subsets). Returns per-sequence logits [len, V]."""
    rng = random.Random(seed)
    block_size, num_blocks = 8, 160
    runner = ModelRunner(model, CFG, allocate_kv_caches(CFG, num_blocks, block_size, dtype, "cpu"),
                         block_size, sampler=None)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for s in seqs:
        nb = -(-len(s) // block_size)
        tables.append(ids[at:at + nb])
        at += nb
    reqs = [Request(f"s{i}", s) for i, s in enumerate(seqs)]
    done = [0] * len(seqs)
    out = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        chosen = [i for i in live if rng.random() < 0.7] or live[:1]
        rng.shuffle(chosen)
        sched = SchedulerOutput()
        for i in chosen:
            n = chunker(rng, len(seqs[i]) - done[i])
            sched.scheduled.append(scheduled(reqs[i], done[i], n, seqs[i][done[i]:done[i] + n], [], tables[i]))
            done[i] += n
        x, pos, md, _ = runner.prepare_inputs(sched)
        logits = model.compute_logits(model(x, pos, md, runner.kv_caches))
        for b, i in enumerate(chosen):
            out[i].append(logits[md.qo_indptr[b]:md.qo_indptr[b + 1]])
    return [torch.cat(o) for o in out]


SCHEDULES = {
    "whole": lambda rng, rem: rem,
    "decode": lambda rng, rem: 1,
    "verify_like": lambda rng, rem: min(rem, rng.choice([1, 2, 3, 4, 5, 6])),
    "random_chunks": lambda rng, rem: min(rem, rng.randint(1, 70)),
}
