"""ModelRunner on a hand-built SchedulerOutput: decode + verify + partial prefill."""

from __future__ import annotations

import torch

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.worker.kv_cache_alloc import (
    allocate_kv_caches,
    num_blocks_for_budget,
)
from tokenbudget.engine.worker.model_runner import ModelRunner
from tokenbudget.engine.worker.sampler import SamplerOutput
from tokenbudget.scheduler.output import SchedulerOutput
from tokenbudget.scheduler.request import Request

from model_helpers import scheduled

CFG = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _sd(cfg):
    g = torch.Generator().manual_seed(0)
    h, d = cfg.hidden_size, cfg.resolved_head_dim
    q, kv, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, h), "model.norm.weight": torch.ones(h),
          "lm_head.weight": r(cfg.vocab_size, h)}
    for L in range(cfg.num_hidden_layers):
        p = f"model.layers.{L}."
        sd |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
               p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
               p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
               p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h),
               p + "mlp.down_proj.weight": r(h, i)}
    return sd


class RecordingSampler:
    """Records what the runner hands the sampler; returns argmax of each request's rows."""

    def __init__(self):
        self.calls = []

    def __call__(self, logits, rows):
        self.calls.append((logits.clone(), rows))
        out, r = [], 0
        for row in rows:
            k = row.num_drafts
            out.append([int(x) for x in logits[r:r + k + 1].argmax(-1)][-1:])
            r += k + 1
        return SamplerOutput(out)



def _stepwise_logits(model, tokens: list[int], bs: int = 4) -> list[torch.Tensor]:
    """Logits at every position of ``tokens``, one token per step through a fresh runner and pool."""
    sampler = RecordingSampler()
    runner = ModelRunner(model, CFG, allocate_kv_caches(CFG, 32, bs, torch.float32, "cpu"), bs, sampler)
    req = Request("ref", list(tokens), sampling_params=SamplingParams(temperature=0.0))
    table = list(range(-(-len(tokens) // bs)))
    for i, t in enumerate(tokens):
        runner.execute(SchedulerOutput([scheduled(req, i, 1, [t], [], table, needs_sample=True)],
                                       total_num_scheduled_tokens=1))
    assert len(sampler.calls) == len(tokens)
    return [logits[0] for logits, _ in sampler.calls]


def test_decode_verify_partial_prefill():
    bs = 4
    sampler = RecordingSampler()
    runner = ModelRunner(build_model(CFG, _sd(CFG)), CFG, allocate_kv_caches(CFG, 32, bs, torch.float32, "cpu"),
                         bs, sampler)
    greedy = SamplingParams(temperature=0.0)
    seeded = SamplingParams(temperature=1.0, seed=7)
    # decode: 9 tokens, 8 computed, 1 scheduled
    a = Request("a", list(range(9)), sampling_params=greedy)
    # verify: 6 committed tokens, 5 computed, last committed + 3 drafts scheduled
    b = Request("b", list(range(10, 16)), sampling_params=seeded, seed=7)
    b.spec_token_ids = [1, 2, 3]
    b.spec_probs = torch.full((3, CFG.vocab_size), 1 / CFG.vocab_size)
    # partial prefill: 20-token prompt, first chunk of 7
    c = Request("c", list(range(20, 40)), sampling_params=greedy)
    sched = SchedulerOutput([
        scheduled(a, 8, 1, [8], [], [3, 9, 30]),
        scheduled(b, 5, 4, [15, 1, 2, 3], [1, 2, 3], [17, 2, 12]),
        scheduled(c, 0, 7, c.all_token_ids[:7], [], [5, 11]),
    ], total_num_scheduled_tokens=12)
    # the computed prefixes of a and b really are in the KV pool (their own blocks)
    runner.execute(SchedulerOutput([scheduled(a, 0, 8, a.all_token_ids[:8], [], [3, 9, 30]),
                                    scheduled(b, 0, 5, b.all_token_ids[:5], [], [17, 2, 12])],
                                   total_num_scheduled_tokens=13))
    ids, pos, md, sample_idx = runner.prepare_inputs(sched)
    assert ids.tolist() == [8, 15, 1, 2, 3] + list(range(20, 27))
    assert pos.tolist() == [8, 5, 6, 7, 8] + list(range(7))
    assert md.slot_mapping.tolist()[:5] == [30 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 12 * 4 + 0]
    assert md.slot_mapping.tolist()[5:] == [20, 21, 22, 23, 44, 45, 46]
    assert md.qo_indptr == [0, 1, 5, 12] and md.kv_lens == [9, 9, 7]
    assert sample_idx.tolist() == [0, 1, 2, 3, 4]

    out = runner.execute(sched)
    assert out.req_ids == ["a", "b", "c"]
    logits, rows = sampler.calls[-1]
    assert logits.shape == (5, CFG.vocab_size) and logits.dtype == torch.float32
    # what the sampler returned (argmax of each request's last row) is what the runner reports
    assert out.sampled_token_ids == [[int(logits[0].argmax())], [int(logits[4].argmax())], []]
    # each row is the same position computed one token at a time, alone: a's decode row and b's
    # four verify rows (positions 5..8). Not bitwise: this tiny shape (hidden 32, head_dim 8) is
    # outside what tests/test_batch_invariance.py covers, and differs by ~4e-7.
    ref_a = _stepwise_logits(runner.model, a.all_token_ids)
    ref_b = torch.stack(_stepwise_logits(runner.model, b.all_token_ids + [1, 2, 3])[5:9])
    torch.testing.assert_close(logits[0], ref_a[8], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[1:5], ref_b, rtol=0, atol=1e-5)
    # the argmax chain of the verify rows is the stepwise one (top-2 gaps well above that error)
    top2 = ref_b.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    assert logits[1:5].argmax(-1).tolist() == ref_b.argmax(-1).tolist()
    assert [r.draft_token_ids for r in rows] == [[], [1, 2, 3]]
    assert rows[0].draft_probs is None and rows[1].draft_probs.shape == (3, CFG.vocab_size)
    # b's rows predict positions 6, 7, 8, 9, its random numbers keyed by its seed
    assert (rows[1].seed, rows[1].position) == (7, 6) and rows[0].position == 9

    # the runner keeps nothing per request: the next chunk of c runs alone
    out2 = runner.execute(SchedulerOutput([scheduled(c, 7, 13, c.all_token_ids[7:], [], [5, 11, 6, 8, 1])]))
    assert len(out2.sampled_token_ids[0]) == 1
    assert sampler.calls[-1][0].shape == (1, CFG.vocab_size)


def test_kv_cache_budget():
    per_block = CFG.num_hidden_layers * 2 * 16 * CFG.num_key_value_heads * CFG.resolved_head_dim * 4
    assert num_blocks_for_budget(CFG, 16, torch.float32, per_block * 10 + 5) == 10
    caches = allocate_kv_caches(CFG, 10, 16, torch.float32, "cpu")
    assert len(caches) == 2 and caches[0].shape == (10, 2, 16, 2, 8)
    import pytest
    with pytest.raises(ValueError, match="memory_bytes"):
        num_blocks_for_budget(CFG, 16, torch.float32, per_block - 1)
