"""FlashInfer attention backend vs the torch reference backend.

The page-table build and import safety run everywhere; the attention comparisons need CUDA and
flashinfer (``cuda`` marker; skipped otherwise). On the GPU box set the FlashInfer JIT variables
for bf16, head_dim 128 and the fa2 backend first.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.attention.flashinfer_backend import build_page_table
from tokenbudget.kernels.kv_write import write_kv_reference

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
    from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferBackend(AttentionSpec(4, 2, 64, 16), "cpu")


# ---- GPU ----------------------------------------------------------------------------------

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16)
NUM_BLOCKS = 96


def _batch(q_lens, kv_lens, seed, device):
    """Random non-contiguous block tables, a cache holding each request's context, new K/V, q."""
    g = torch.Generator().manual_seed(seed)
    bs, hk, d, h = SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim, SPEC.num_heads
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, qo, slots = [], [0], []
    cache = torch.randn(NUM_BLOCKS, 2, bs, hk, d, generator=g).to(device, SPEC.dtype)
    for q_len, kv_len in zip(q_lens, kv_lens):
        n = -(-kv_len // bs) + 1  # one spare block, like a real block table
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        qo.append(qo[-1] + q_len)
        ctx = kv_len - q_len
        ctx_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)], dtype=torch.long)
        kc = torch.randn(ctx, hk, d, generator=g).to(device, SPEC.dtype)
        write_kv_reference(kc, torch.randn_like(kc), cache, ctx_slots.to(device))
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, kv_len)]
    t = qo[-1]
    tp = t + 3  # padding rows, like the model's pad_rows
    k = torch.randn(tp, hk, d, generator=g).to(device, SPEC.dtype)
    v = torch.randn(tp, hk, d, generator=g).to(device, SPEC.dtype)
    q = torch.randn(tp, h, d, generator=g).to(device, SPEC.dtype)
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
@pytest.mark.parametrize("use_decode_kernel", [True, False])
@pytest.mark.cuda
@needs_cuda
@needs_flashinfer
def test_flashinfer_matches_torch_ref(name, use_decode_kernel):
    from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend
    from tokenbudget.kernels.attention.torch_ref import TorchRefBackend

    args = _batch(*BATCHES[name], seed=len(name), device="cuda")
    fi = FlashInferBackend(SPEC, "cuda", use_decode_kernel=use_decode_kernel)
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
    from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend

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
