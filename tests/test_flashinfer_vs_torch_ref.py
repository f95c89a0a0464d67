"""The FlashInfer backend, driven on CPU through ``flashinfer_standin``, against attention computed
without any page table.

The stand-in tests elsewhere compare the stand-in with itself (eager vs graph, alone vs mixed), so
a page-table bug shared by both paths would pass them. Here each request's keys and values are
kept as plain tensors, the expected output is dense causal GQA attention over them in float64,
and the paged cache is read back through each request's block table (not the slot mapping the
backend was given). The same batch runs through the torch reference backend, so the two CPU-run
backends are checked against one independent answer on mixed, decode, verify and padded batches.
"""

from __future__ import annotations

import pytest
import torch

from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend
from tokenbudget.kernels.attention.torch_ref import TorchRefBackend

import flashinfer_standin as fis

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)

BATCHES = {  # (q_lens, kv_lens): kv_len counts the context already cached plus the new rows
    "mixed": ([37, 20, 4, 1, 3], [37, 50, 29, 17, 40]),  # a prefill, a chunk, verifies, a decode
    "decode": ([1, 1, 1, 1], [1, 33, 16, 70]),
    "verify": ([5, 5, 5], [5, 31, 300]),  # 1 + 4 drafts; 300: many pages, > 1 key tile
    "long_prefill": ([300], [300]),
}


BACKENDS = {"flashinfer_standin": lambda: FlashInferBackend(SPEC, "cpu", flashinfer=fis, num_sms=132),
            "torch_ref": lambda: TorchRefBackend(SPEC, "cpu")}


class Batch:
    """Random requests over shuffled, non-contiguous block tables; each request's full K/V kept
    densely (``keys[i]``, ``values[i]``: context then new rows) beside the paged cache."""

    def __init__(self, q_lens, kv_lens, seed: int, pad: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        bs, hk, d, h = SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim, SPEC.num_heads
        num_blocks = sum(-(-n // bs) + 1 for n in kv_lens) + 4
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.cache = torch.randn(num_blocks, 2, bs, hk, d, generator=g)  # stale garbage everywhere
        self.qo, self.kv_lens, self.tables, self.keys, self.values = [0], list(kv_lens), [], [], []
        slots, new_k, new_v = [], [], []
        for q_len, kv_len in zip(q_lens, kv_lens):
            n = -(-kv_len // bs) + 1  # one spare block, like a real block table
            table, perm = perm[:n], perm[n:]
            self.tables.append(table)
            self.qo.append(self.qo[-1] + q_len)
            keys, values = torch.randn(kv_len, hk, d, generator=g), torch.randn(kv_len, hk, d, generator=g)
            self.keys.append(keys)
            self.values.append(values)
            ctx = kv_len - q_len
            for p in range(ctx):  # the cached context, written by hand through the table
                self.cache[table[p // bs], 0, p % bs] = keys[p]
                self.cache[table[p // bs], 1, p % bs] = values[p]
            slots += [table[p // bs] * bs + p % bs for p in range(ctx, kv_len)]
            new_k.append(keys[ctx:])
            new_v.append(values[ctx:])
        t = self.qo[-1]
        self.slots = torch.tensor(slots, dtype=torch.long)
        # padding rows (the model pads T) carry junk that must neither be written nor leak out
        self.k = torch.cat([*new_k, torch.full((pad, hk, d), 7.0)])
        self.v = torch.cat([*new_v, torch.full((pad, hk, d), 7.0)])
        self.q = torch.randn(t + pad, h, d, generator=g)

    def dense_attention(self) -> torch.Tensor:
        """Causal GQA attention per request from the dense K/V, float64; ``[T, H, D]``."""
        group = SPEC.num_heads // SPEC.num_kv_heads
        out = []
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            q = self.q[self.qo[i]:self.qo[i + 1]].double()  # [n, H, D]
            k = keys.double().repeat_interleave(group, dim=1)  # [L, H, D]
            v = values.double().repeat_interleave(group, dim=1)
            n, length = q.shape[0], k.shape[0]
            scores = torch.einsum("nhd,lhd->hnl", q, k) * SPEC.softmax_scale
            visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]  # [n, L]
            scores = scores.masked_fill(~visible, float("-inf"))
            out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v))
        return torch.cat(out)

    def assert_cache_holds_every_request(self, cache: torch.Tensor) -> None:
        """Read back through each block table: position p of request i is at table[p // bs]."""
        bs = SPEC.block_size
        for table, keys, values in zip(self.tables, self.keys, self.values):
            pos = torch.arange(keys.shape[0])
            blocks, offs = torch.tensor(table)[pos // bs], pos % bs
            assert torch.equal(cache[blocks, 0, offs], keys) and torch.equal(cache[blocks, 1, offs], values)


def _run_eager(backend, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    md = backend.build_metadata(b.qo, b.kv_lens, b.tables, b.slots)
    cache = b.cache.clone()
    backend.write_kv(b.k, b.v, cache, md)
    return backend.attend(b.q, cache, md), cache


@pytest.mark.parametrize("backend", ["flashinfer_standin", "torch_ref"])
@pytest.mark.parametrize("name,pad", [(n, 0) for n in sorted(BATCHES)] + [("mixed", 3), ("decode", 5)])
def test_backend_matches_dense_attention(backend, name, pad):
    b = Batch(*BATCHES[name], seed=len(name) + pad, pad=pad)
    out, cache = _run_eager(BACKENDS[backend](), b)
    t = b.qo[-1]
    b.assert_cache_holds_every_request(cache)
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[[blk for table in b.tables for blk in table]] = False
    assert torch.equal(cache[untouched], b.cache[untouched]), "a write landed outside every block table"
    assert out.shape[0] == t + pad and torch.count_nonzero(out[t:]) == 0, "padding rows must be zero"
    torch.testing.assert_close(out[:t].double(), b.dense_attention(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_len,kv_lens", [(1, [5, 40, 17]), (5, [5, 300, 26])])
def test_graph_bucket_padded_with_dummy_requests_matches_dense_attention(q_len, kv_lens):
    """The CUDA-graph path: a fixed bucket of 8 requests (5 of them dummies) and padded rows."""
    fi = BACKENDS["flashinfer_standin"]()
    b = Batch([q_len] * len(kv_lens), kv_lens, seed=q_len)
    state = fi.graph_state(batch_size=8, q_len=q_len, max_pages=8 * 24)
    md = state.prepare(b.qo, b.kv_lens, b.tables, b.slots)
    n, t = md.num_tokens, b.qo[-1]

    def pad(x):
        return torch.cat([x[:t], x.new_full((n - t,) + x.shape[1:], 7.0)])
    cache = b.cache.clone()
    fi.write_kv(pad(b.k), pad(b.v), cache, md)
    out = fi.attend(pad(b.q), cache, md)
    b.assert_cache_holds_every_request(cache)
    assert torch.count_nonzero(out[t:]) == 0
    torch.testing.assert_close(out[:t].double(), b.dense_attention(), atol=2e-5, rtol=2e-5)
