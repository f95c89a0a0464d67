"""FlashInfer attention backend: planning and numerics on CPU through the stand-in
(``flashinfer_standin``: 0.6.18.post1's wrapper signatures and planning rules, torch math), and
vs the torch reference backend on a GPU (``cuda`` marker; skipped otherwise).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.attention.flashinfer_backend import DEFAULT_WORKSPACE_BYTES, FlashInferBackend
from tokenbudget.kernels.attention.flashinfer_plan import build_page_table, eager_workspace_bytes
from tokenbudget.kernels.kv_write import write_kv_reference

import flashinfer_standin as fis

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")


def test_build_page_table_csr():
    pt = build_page_table([0, 3, 4, 8], [10, 4, 5], [[7, 2, 9, 5], [3, 8], [1, 6, 0]], 4)
    assert pt.qo_indptr.tolist() == [0, 3, 4, 8]
    assert pt.kv_indptr.tolist() == [0, 3, 4, 6]
    assert pt.kv_indices.tolist() == [7, 2, 9, 3, 1, 6]
    assert pt.kv_last_page_len.tolist() == [2, 4, 1]
    assert pt.kv_indices.dtype == torch.int32


def test_backend_refuses_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferBackend(AttentionSpec(4, 2, 64, 16), "cpu")


# ---- CPU, through the stand-in ------------------------------------------------------------

SHAPE_8B = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=32, block_size=16, dtype=torch.float32)


def _standin(spec=SHAPE_8B, **kw):
    return FlashInferBackend(spec, "cpu", flashinfer=fis, num_sms=132, **kw)


def _attend(backend, q_lens, kv_lens, seed, spec=SHAPE_8B, pad=3):
    qo, kv, tables, slots, cache, q, k, v = _batch(q_lens, kv_lens, seed, "cpu", spec, pad)
    return _run(backend, qo, kv, tables, slots, cache, q, k, v), qo


def test_padding_rows_zero_and_output_is_the_run_buffer():
    """Padding (the model's rows past T, a graph bucket's padding requests) is zeroed in the
    buffer the kernel wrote: no per-layer [T, H, D] zero tensor, no torch.where copy."""
    be = _standin()
    (out, _), qo = _attend(be, [3, 3], [40, 17], seed=1)
    t = qo[-1]
    assert out.shape[0] == t + 3 and torch.count_nonzero(out[t:]) == 0
    assert out.data_ptr() == be.uniform_wrapper(3).last_out.data_ptr()
    qo, kv, tables, slots, cache, q, k, v = _batch([1, 1], [40, 17], 1, "cpu", SHAPE_8B, 0)
    state = be.graph_state(batch_size=4, q_len=1, max_pages=64)
    md = state.prepare(qo, kv, tables, slots)
    for rows in (4, 8):  # bucket rows exactly, and padded further by the model
        got = be.attend(torch.cat([q, q.new_ones(rows - 2, *q.shape[1:])]), cache, md)
        assert got.data_ptr() == state.wrapper.last_out.data_ptr()
        assert torch.count_nonzero(got[2:]) == 0 and torch.count_nonzero(got[:2]) > 0


def test_decode_row_bits_do_not_depend_on_neighbours():
    """A long-context decode alone vs next to three long prefill chunks: before, one prefill plan
    for the mixed batch picked a KV split from the whole batch, so the row's bits changed."""
    be = _standin()
    qo, kv, tables, slots, cache, q, k, v = _batch([1, 256, 256, 256], [1000, 2048, 2048, 2048],
                                                   2, "cpu", SHAPE_8B, 0)
    mixed, _ = _run(be, qo, kv, tables, slots, cache, q, k, v)
    alone, _ = _run(be, [0, 1], kv[:1], tables[:1], slots[:1], cache, q[:1], k[:1], v[:1])
    assert torch.equal(mixed[:1], alone)
    kinds = {p.kernel for w in [be._prefill, *be._uniform.values()] for p in w.plans}
    assert kinds == {"prefill", "decode_tc"}


def test_graph_verify_plan_and_bits_equal_eager():
    be = _standin()
    (eager, _), _ = _attend(be, [4, 4], [500, 900], seed=3, pad=0)
    qo_, kv, tables, slots, cache, q, k, v = _batch([4, 4], [500, 900], 3, "cpu", SHAPE_8B, 0)
    state = be.graph_state(batch_size=32, q_len=4, max_pages=32 * 64)  # 30 dummy requests
    md = state.prepare(qo_, kv, tables, slots)
    n = md.num_tokens
    padq = torch.cat([q, q.new_zeros(n - q.shape[0], *q.shape[1:])])
    gcache = cache.clone()
    be.write_kv(torch.cat([k, k.new_zeros(n - 8, *k.shape[1:])]),
                torch.cat([v, v.new_zeros(n - 8, *v.shape[1:])]), gcache, md)
    out = be.attend(padq, gcache, md)
    assert torch.equal(out[:8], eager) and torch.count_nonzero(out[8:]) == 0
    g, e = state.wrapper.plans[-1], be.uniform_wrapper(4).plans[-1]
    assert (g.kernel, g.cta_tile_q, g.split_kv) == (e.kernel, e.cta_tile_q, e.split_kv) == ("decode_tc", 16, False)


def test_largest_verify_bucket_fits_the_workspace():
    """B = 64 verify bucket on an 8B shape (32 q heads, 8 kv heads, head_dim 128): the ragged
    cuda-graph prefill plan reserved ~153 MiB of split-KV scratch ("Buffer overflow" in 128)."""
    spec = AttentionSpec(32, 8, 128, 16, torch.float32)
    be = _standin(spec)
    state = be.graph_state(batch_size=64, q_len=5, max_pages=64 * 8)
    qo = list(range(0, 64 * 5 + 1, 5))
    state.prepare(qo, [100] * 64, [list(range(7))] * 64, torch.arange(320))
    assert state.wrapper.plans[-1].float_workspace <= be.workspace.numel()
    # the eager prefill plan's worst case is covered too (a 70B shape needs more than 128 MiB)
    big = AttentionSpec(64, 8, 128, 16, torch.float32)
    assert eager_workspace_bytes(big, 132) > DEFAULT_WORKSPACE_BYTES
    assert _standin(big).workspace.numel() >= eager_workspace_bytes(big, 132)


def test_deterministic_disables_the_prefill_split():
    for det, split in ((False, True), (True, False)):
        be = _standin(deterministic=det)
        _attend(be, [64, 64], [3000, 64], seed=4, pad=0)
        assert be._prefill.plans[-1].split_kv is split
        # decode rows: never CUDA-core decode (whose plan ignores disable_split_kv), never split
        assert all(w.use_tensor_cores and not w.plans[-1].split_kv for w in be._uniform.values())


def test_deterministic_decode_and_verify_share_one_plan():
    """N4: the CTA tile comes from the packed rows L * G; on a GQA-4 layout a decode (4 rows,
    tile 16) and a 5-row verify (20 rows, tile 64) ran different kernels. Deterministic mode plans
    every decode/verify with one L (rows padded): one tile, one kernel, whatever k."""
    for det in (False, True):
        be = _standin(deterministic=det)
        (verify, _), _ = _attend(be, [5], [300], seed=6, pad=0)
        _, _, tables, slots, cache, q, k, v = _batch([5], [300], 6, "cpu", SHAPE_8B, 0)
        decode, _ = _run(be, [0, 1], [296], tables, slots[:1], cache, q[:1], k[:1], v[:1])
        assert torch.equal(decode[0], verify[0])
        tiles = {p.cta_tile_q for w in be._uniform.values() for p in w.plans}
        assert (len(tiles) == 1) is det, tiles
        # a mixed batch (decode, two verifies of different k, a prefill chunk) plans one uniform
        # group; its real rows get what the per-q_len plans give (the stand-in's math is per row)
        (mixed, _), qo = _attend(be, [1, 3, 5, 40], [90, 60, 300, 40], seed=7, pad=2)
        assert (len(be._uniform) == 1) is det
        (plain, _), _ = _attend(_standin(), [1, 3, 5, 40], [90, 60, 300, 40], seed=7, pad=2)
        assert torch.equal(mixed, plain) and torch.count_nonzero(mixed[qo[-1]:]) == 0


def test_graph_bucket_padding_ctas_read_zeroed_scheduler_entries(monkeypatch):
    """N1 (flashinfer #4002): a graph bucket's grid is padded to 2 * #SM / num_kv_heads CTAs but
    plan() writes scheduler entries for the real tiles only; the rest came from recycled pinned
    memory (wild request indices). The graph state zeroes both int workspaces at creation."""
    be = _standin()
    qo, kv, tables, slots, cache, q, k, v = _batch([1, 1], [40, 17], 5, "cpu", SHAPE_8B, 0)
    state = be.graph_state(batch_size=2, q_len=1, max_pages=64)
    md = state.prepare(qo, kv, tables, slots)
    be.attend(q, cache, md)
    grid = 2 * fis.NUM_SMS // SHAPE_8B.num_kv_heads       # 33 CTAs for 2 real tiles
    entries = state.wrapper._int_workspace_buffer.view(torch.int32)[:grid]
    assert entries[:2].tolist() == [0, 1] and not entries[2:].any()
    # without the zeroing the stand-in fails where the GPU would read out of range
    from tokenbudget.kernels.attention import flashinfer_backend
    monkeypatch.setattr(flashinfer_backend, "zero_int_workspaces", lambda wrapper: None)
    state = be.graph_state(batch_size=2, q_len=1, max_pages=64)
    md = state.prepare(qo, kv, tables, slots)
    with pytest.raises(RuntimeError, match="illegal memory access.*request index 16843009"):
        be.attend(q, cache, md)


def test_model_runner_passes_deterministic_to_the_selector(monkeypatch):
    from tokenbudget.engine.model.config import ModelConfig
    from tokenbudget.engine.worker import model_runner
    from tokenbudget.kernels.attention.torch_ref import TorchRefBackend

    seen = {}

    def select(device, spec, *, deterministic=False, attends_itself=""):
        seen["deterministic"] = deterministic
        return TorchRefBackend(spec, device)

    monkeypatch.setattr(model_runner, "select_attention_backend", select)
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    cache = [torch.zeros(2, 2, 16, 1, 4)]
    model_runner.ModelRunner(None, cfg, cache, 16, None, "cpu", deterministic=True)
    assert seen == {"deterministic": True}


# ---- GPU ----------------------------------------------------------------------------------

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16)
NUM_BLOCKS = 96


def _batch(q_lens, kv_lens, seed, device, spec=SPEC, pad=3):
    """Random non-contiguous block tables, a cache holding each request's context, new K/V, q."""
    g = torch.Generator().manual_seed(seed)
    bs, hk, d, h = spec.block_size, spec.num_kv_heads, spec.head_dim, spec.num_heads
    num_blocks = max(NUM_BLOCKS, sum(-(-n // bs) + 1 for n in kv_lens))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, qo, slots = [], [0], []
    cache = torch.randn(num_blocks, 2, bs, hk, d, generator=g).to(device, spec.dtype)
    for q_len, kv_len in zip(q_lens, kv_lens):
        n = -(-kv_len // bs) + 1  # one spare block, like a real block table
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        qo.append(qo[-1] + q_len)
        ctx = kv_len - q_len
        ctx_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)], dtype=torch.long)
        kc = torch.randn(ctx, hk, d, generator=g).to(device, spec.dtype)
        write_kv_reference(kc, torch.randn(kc.shape, generator=g).to(device, spec.dtype), cache,
                           ctx_slots.to(device))
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, kv_len)]
    t = qo[-1]
    tp = t + pad  # padding rows, like the model's pad_rows
    k = torch.randn(tp, hk, d, generator=g).to(device, spec.dtype)
    v = torch.randn(tp, hk, d, generator=g).to(device, spec.dtype)
    q = torch.randn(tp, h, d, generator=g).to(device, spec.dtype)
    return qo, list(kv_lens), tables, torch.tensor(slots, dtype=torch.long, device=device), cache, q, k, v


def _run(backend, qo, kv_lens, tables, slots, cache, q, k, v):
    md = backend.build_metadata(qo, kv_lens, tables, slots)
    cache = cache.clone()
    backend.write_kv(k, v, cache, md)
    return backend.attend(q, cache, md), cache


BATCHES = {
    "mixed": ([37, 20, 4, 1, 3], [37, 50, 29, 17, 40]),   # prefill, chunk, verifies, decode
    "decode": ([1, 1, 1, 1], [1, 33, 16, 70]),
    "verify": ([4, 4, 4], [4, 31, 64]),
}


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.cuda
@needs_cuda
@needs_flashinfer
def test_flashinfer_matches_torch_ref(name, deterministic):
    from tokenbudget.kernels.attention.torch_ref import TorchRefBackend

    args = _batch(*BATCHES[name], seed=len(name), device="cuda")
    fi = FlashInferBackend(SPEC, "cuda", deterministic=deterministic)
    out, cache = _run(fi, *args)
    ref_out, ref_cache = _run(TorchRefBackend(SPEC, "cuda"), *args)
    t = args[0][-1]
    assert torch.equal(cache, ref_cache), "K/V writes differ"
    assert torch.count_nonzero(out[t:]) == 0, "padding rows must be zero"
    torch.testing.assert_close(out[:t].float(), ref_out[:t].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@needs_cuda
@needs_flashinfer
def test_flashinfer_graph_state_matches_eager():
    fi = FlashInferBackend(SPEC, "cuda")
    for q_len, kv_lens in ((1, [5, 40, 17]), (3, [3, 40, 26])):
        qo, kv, tables, slots, cache, q, k, v = _batch([q_len] * 3, kv_lens, 7, "cuda")
        t = qo[-1]
        eager, eager_cache = _run(fi, qo, kv, tables, slots, cache, q[:t], k[:t], v[:t])
        state = fi.graph_state(batch_size=8, q_len=q_len, max_pages=8 * 8)
        md = state.prepare(qo, kv, tables, slots)
        n = md.num_tokens  # bucket rows, 8 * q_len
        pad = lambda x: torch.cat([x[:t], x.new_zeros((n - t,) + x.shape[1:])])  # noqa: E731
        gcache = cache.clone()
        fi.write_kv(pad(k), pad(v), gcache, md)
        out = fi.attend(pad(q), gcache, md)
        assert torch.equal(gcache, eager_cache)
        assert torch.count_nonzero(out[t:]) == 0
        torch.testing.assert_close(out[:t], eager, atol=1e-2, rtol=1e-2)
