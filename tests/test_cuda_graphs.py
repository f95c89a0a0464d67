"""CUDA-graph runner over the real ``DecoderLM`` (tiny random config), on CPU.

The FlashInfer stand-in (``flashinfer_standin``) gives the backend its wrappers and a replay
driver stands in for ``torch.cuda`` graphs (a replay re-runs the captured forward over the same
static buffers), so capture, bucketing, padding (the model pads its rows to a multiple of 4),
draft-count padding and planning counts all run here. Real kernels and real graphs: the GPU
section at the end (``cuda`` marker) and ``benches/gpu_check.py``.
"""

from __future__ import annotations

import importlib.util

import msgspec
import pytest
import torch

from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.worker.cuda_graphs import CUDAGraphRunner
from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend

import flashinfer_standin as fis
from batch_schedules import random_state_dict
from replay_driver import ReplayDriver

CFG = ModelConfig(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=512, tie_word_embeddings=True)
BLOCK, NUM_BLOCKS, MAX_PAGES = 16, 64, 256 // 16


def _spec():
    return AttentionSpec(CFG.num_attention_heads, CFG.num_key_value_heads, CFG.resolved_head_dim,
                         BLOCK, torch.float32)


@pytest.fixture(scope="module")
def setup():
    model = build_model(CFG, random_state_dict(CFG, seed=4), torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(NUM_BLOCKS, 2, BLOCK, CFG.num_key_value_heads, CFG.resolved_head_dim,
                          generator=g) for _ in range(CFG.num_hidden_layers)]
    backend = FlashInferBackend(_spec(), "cpu", flashinfer=fis, num_sms=132)
    # (2, 1) and (3, 3): B*L not a multiple of 4, where the model's row padding used to crash
    runner = CUDAGraphRunner(model, caches, backend, batch_sizes=(1, 2, 3), draft_lens=(0, 2),
                             max_pages_per_req=MAX_PAGES, driver=ReplayDriver())
    runner.capture()
    return model, caches, backend, runner


def _step(q_lens, kv_lens, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    qo, tables, pos, slots = [0], [], [], []
    for q_len, kv_len in zip(q_lens, kv_lens):
        n = -(-kv_len // BLOCK)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        qo.append(qo[-1] + q_len)
        for p in range(kv_len - q_len, kv_len):
            pos.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
    ids = torch.randint(0, CFG.vocab_size, (qo[-1],), generator=g)
    return qo, list(kv_lens), tables, ids, torch.tensor(pos), torch.tensor(slots)


def _compare(setup, q_lens, kv_lens, seed):
    """Graph replay vs the eager forward of the same step: same bits, same cache writes."""
    model, caches, backend, runner = setup
    qo, kv, tables, ids, pos, slots = _step(q_lens, kv_lens, seed)
    snapshot = [c.clone() for c in caches]
    eager_caches = [c.clone() for c in caches]
    want = model(ids, pos, backend.build_metadata(qo, kv, tables, slots), eager_caches).clone()
    fis.plan_calls = 0
    got = runner(ids, pos, backend.build_metadata(qo, kv, tables, slots), caches).clone()
    plans = fis.plan_calls
    for c, e in zip(caches, eager_caches):
        assert torch.equal(c, e), "K/V writes differ"
    for c, s in zip(caches, snapshot):
        c.copy_(s)
    assert torch.equal(got, want)
    return got, plans


def test_every_bucket_captures_despite_row_padding(setup):
    runner = setup[3]
    assert sorted(runner.graphs) == [(b, q) for b in (1, 2, 3) for q in (1, 3)]
    assert runner.driver.captures == 6


def test_decode_and_verify_replays_match_eager(setup):
    assert setup[3]._bucket_for([0, 1, 2]) is setup[3].graphs[(2, 1)]
    _compare(setup, [1, 1], [9, 40], seed=1)        # (2, 1): T = 2, the model pads to 4
    _compare(setup, [1], [130], seed=2)
    _compare(setup, [3, 3, 3], [20, 33, 100], seed=3)
    _compare(setup, [3, 3], [3, 7], seed=4)         # (2, 3): T = 6, the model pads to 8


def test_varying_draft_counts_are_padded_into_the_graph(setup):
    runner = setup[3]
    assert runner._bucket_for([0, 3, 4, 6]) is runner.graphs[(3, 3)]   # k = 2, 0, 1
    _compare(setup, [3, 1, 2], [50, 17, 90], seed=5)
    _compare(setup, [2, 2], [16, 33], seed=6)       # k = 1 was not captured: runs in L = 3


def test_a_replayed_step_plans_once(setup):
    _, plans = _compare(setup, [1, 1, 1], [12, 60, 5], seed=7)
    assert plans == 1
    _, plans = _compare(setup, [3, 2], [12, 60], seed=8)
    assert plans == 1


def test_unbucketed_batches_run_eagerly(setup):
    runner = setup[3]
    assert runner._bucket_for([0, 5, 6]) is None        # a 5-row prefill chunk: L = 3 max
    assert runner._bucket_for([0, 1, 2, 3, 4]) is None  # 4 requests > 3
    _, plans = _compare(setup, [5, 1], [5, 30], seed=9)
    assert plans == 2                                    # eager: a prefill and a decode group


def test_deterministic_graphs_are_planned_like_eager(setup):
    """N4/N7: deterministic mode plans eager groups and every bucket's attention with one L (the
    tile floor of 16 rows: 9 for this GQA-2 layout), so a padded replay runs the eager kernel;
    the model itself runs the bucket's own rows (B * L, not B * 16: the H200 run measured a
    64-request decode bucket at 107 ms when every request was inflated to 16 rows in the GEMMs)."""
    model, caches, _, _ = setup
    backend = FlashInferBackend(_spec(), "cpu", flashinfer=fis, num_sms=132, deterministic=True)
    runner = CUDAGraphRunner(model, caches, backend, batch_sizes=(1, 3), draft_lens=(0, 2),
                             max_pages_per_req=MAX_PAGES, driver=ReplayDriver())
    runner.capture()
    assert sorted(runner.graphs) == [(1, 1), (1, 3), (3, 1), (3, 3)]
    assert runner.graphs[(3, 1)].attn.num_tokens == 3
    assert backend.q_len_floor == 9 and runner.graphs[(3, 1)].attn.plan_len == 9
    for q_lens in ([3, 1, 2], [1, 1, 1], [1]):
        _compare((model, caches, backend, runner), q_lens, [50, 17, 90][:len(q_lens)], seed=5)
        graph = runner._bucket_for(list(_offsets(q_lens))).attn.wrapper.plans[-1]
        eager = backend.uniform_wrapper(9).plans[-1]
        assert (graph.kernel, graph.cta_tile_q, graph.split_kv) == (eager.kernel, eager.cta_tile_q, False)


def _offsets(q_lens):
    out = [0]
    for q in q_lens:
        out.append(out[-1] + q)
    return out


def test_aligned_tiles_put_decodes_and_verifies_on_one_tile(setup):
    """Default mode with ``align_tiles(1 + k)``: a GQA-4 decode (4 packed rows) used to run tile 16
    and a 5-row verify (20) tile 64, so greedy speculation drifted from plain decoding at k >= 4
    (H200: match 0.02 with an oracle drafter). Aligned, every decode and verify of a request — eager
    or replayed, padded or not — plans the same CTA tile, and the graph's output equals eager."""
    model, caches, _, _ = setup
    spec = AttentionSpec(8, 2, CFG.resolved_head_dim, BLOCK, torch.float32)  # G = 4
    backend = FlashInferBackend(spec, "cpu", flashinfer=fis, num_sms=132)
    assert [backend.planned_q_len(q) for q in (1, 3, 5)] == [1, 3, 5]     # not aligned: own L
    backend.align_tiles(5)
    assert [backend.planned_q_len(q) for q in (1, 3, 5, 9)] == [5, 5, 5, 9]
    tiles = set()
    for q_lens in ([1, 1], [5, 5], [2, 5], [1, 3]):
        backend.build_metadata(_offsets(q_lens), [40, 60], [[0, 1, 2, 3], [4, 5, 6, 7]],
                               torch.zeros(sum(q_lens), dtype=torch.long))
        md = backend.build_metadata(_offsets(q_lens), [40, 60], [[0, 1, 2, 3], [4, 5, 6, 7]],
                                    torch.zeros(sum(q_lens), dtype=torch.long))
        for g in md.backend_data.groups:
            backend.plan(g.wrapper, g.q_len, g.page_table)
            tiles.add(g.wrapper.plans[-1].cta_tile_q)
    assert tiles == {64}


def test_verify_longer_than_a_uniform_group_runs_eagerly(setup):
    """max_spec_tokens >= 16 with graphs used to fail start-up (bad graph bucket q_len=17)."""
    model, caches, backend, _ = setup
    runner = CUDAGraphRunner(model, caches, backend, batch_sizes=(1,), draft_lens=(0, 16),
                             max_pages_per_req=MAX_PAGES, driver=ReplayDriver())
    runner.capture()
    assert sorted(runner.graphs) == [(1, 1)]
    assert runner._bucket_for([0, 17]) is None


def test_graphs_keep_the_taps_like_the_eager_forward(setup):
    """EAGLE-3 taps (set_aux_layers) recapture the graphs, which then return the eager forward's
    taps and hidden state bit for bit: padded buckets, padded draft counts, and the eager path."""
    model, caches, backend, _ = setup
    runner = CUDAGraphRunner(model, caches, backend, batch_sizes=(1, 2, 3), draft_lens=(0, 2),
                             max_pages_per_req=MAX_PAGES, driver=ReplayDriver())
    runner.capture()
    try:
        runner.set_aux_layers((1, 0))
        assert runner.driver.captures == 12 and runner.aux_layers == (1, 0)
        for q_lens, kv_lens, seed in (([1, 1], [9, 40], 1), ([3, 1, 2], [50, 17, 90], 5), ([5, 1], [5, 30], 9)):
            qo, kv, tables, ids, pos, slots = _step(q_lens, kv_lens, seed)
            snapshot = [c.clone() for c in caches]
            want, want_aux = model(ids, pos, backend.build_metadata(qo, kv, tables, slots),
                                   [c.clone() for c in caches], aux_layers=(1, 0))
            got, got_aux = runner(ids, pos, backend.build_metadata(qo, kv, tables, slots), caches, aux_layers=(1, 0))
            for c, s in zip(caches, snapshot):
                c.copy_(s)
            assert want_aux.shape == (qo[-1], 2 * CFG.hidden_size)
            assert torch.equal(got, want) and torch.equal(got_aux, want_aux)
        with pytest.raises(ValueError, match="aux_layers"):  # the graphs hold the taps they were captured with
            runner(ids, pos, backend.build_metadata(qo, kv, tables, slots), caches)
        runner.set_aux_layers(None)
        assert runner.driver.captures == 18
        qo, kv, tables, ids, pos, slots = _step([1], [20], 2)
        snapshot = [c.clone() for c in caches]
        out = runner(ids, pos, backend.build_metadata(qo, kv, tables, slots), caches)
        for c, s in zip(caches, snapshot):
            c.copy_(s)
        assert isinstance(out, torch.Tensor)  # no taps asked, none returned
    finally:
        runner.set_aux_layers(None)


# ---- GPU ----------------------------------------------------------------------------------

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _real_graphs():
    """A bf16 model on the GPU, its caches and backend, and a captured graph runner."""
    dev = torch.device("cuda")
    cfg = msgspec.structs.replace(CFG, head_dim=64)  # FlashInfer wants head_dim >= 64
    model = build_model(cfg, random_state_dict(cfg, seed=4), torch.bfloat16, dev)
    spec = AttentionSpec(CFG.num_attention_heads, CFG.num_key_value_heads, 64, BLOCK, torch.bfloat16)
    caches = [torch.zeros(NUM_BLOCKS, 2, BLOCK, CFG.num_key_value_heads, 64, dtype=torch.bfloat16,
                          device=dev) for _ in range(CFG.num_hidden_layers)]
    backend = FlashInferBackend(spec, dev)
    runner = CUDAGraphRunner(model, caches, backend, batch_sizes=(1, 2, 3), draft_lens=(0, 2),
                             max_pages_per_req=MAX_PAGES)
    runner.capture()
    return dev, model, caches, backend, runner


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
def test_real_cuda_graphs_match_eager():
    dev, model, caches, backend, runner = _real_graphs()
    qo, kv, tables, ids, pos, slots = _step([3, 1, 2], [50, 17, 90], seed=5)
    ids, pos, slots = ids.to(dev), pos.to(dev), slots.to(dev)
    eager = [c.clone() for c in caches]
    want = model(ids, pos, backend.build_metadata(qo, kv, tables, slots), eager)
    got = runner(ids, pos, backend.build_metadata(qo, kv, tables, slots), caches)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
def test_real_cuda_graphs_keep_the_taps():
    dev, model, caches, backend, runner = _real_graphs()
    runner.set_aux_layers((1, 0))  # recaptures with the taps
    qo, kv, tables, ids, pos, slots = _step([3, 1, 2], [50, 17, 90], seed=5)
    ids, pos, slots = ids.to(dev), pos.to(dev), slots.to(dev)
    want, want_aux = model(ids, pos, backend.build_metadata(qo, kv, tables, slots), [c.clone() for c in caches],
                           aux_layers=(1, 0))
    got, got_aux = runner(ids, pos, backend.build_metadata(qo, kv, tables, slots), caches, aux_layers=(1, 0))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert got_aux.dtype == torch.float32
    torch.testing.assert_close(got_aux, want_aux, atol=2e-2, rtol=2e-2)


def test_logits_are_not_rounded_to_bf16():
    model = build_model(CFG, random_state_dict(CFG, seed=4), torch.bfloat16, "cpu")
    hidden = torch.randn(3, CFG.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())
    ref = hidden.float() @ model.embed.float().t()
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
