"""CUDA-graph runner: replay == eager for decode and verify buckets; eager fallback otherwise.

Needs CUDA, flashinfer and triton (``cuda`` marker; skipped otherwise). Uses a toy two-layer
attention model with the real model's ``forward`` signature so the test exercises the runner,
the FlashInfer graph wrappers and the Triton K/V write, not a checkpoint.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.triton_utils import HAS_TRITON

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed"),
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
]

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16)
VOCAB, NUM_BLOCKS, LAYERS, MAX_POS = 512, 64, 2, 256


class ToyModel:
    """embed + positional table -> LAYERS x (qkv, write_kv, attend, o) -> hidden."""

    def __init__(self, device):
        g = torch.Generator().manual_seed(0)
        h, hk, d = SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_dim
        w = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(device, SPEC.dtype)  # noqa: E731
        self.embed, self.pos = w(VOCAB, h * d), w(MAX_POS, h * d)
        self.layers = [(w((h + 2 * hk) * d, h * d), w(h * d, h * d)) for _ in range(LAYERS)]

    @torch.inference_mode()
    def __call__(self, input_ids, positions, md, kv_caches):
        h, hk, d = SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_dim
        t = input_ids.shape[0]
        x = self.embed[input_ids] + self.pos[positions]
        for (qkv_w, o_w), cache in zip(self.layers, kv_caches):
            qkv = F.linear(x, qkv_w)
            q = qkv[:, :h * d].view(t, h, d)
            k = qkv[:, h * d:(h + hk) * d].view(t, hk, d)
            v = qkv[:, (h + hk) * d:].view(t, hk, d)
            md.backend.write_kv(k, v, cache, md)
            x = x + F.linear(md.backend.attend(q, cache, md).reshape(t, h * d), o_w)
        return x

    def compute_logits(self, hidden):
        return F.linear(hidden, self.embed).float()


def _step(q_lens, kv_lens, seed):
    """Block tables (distinct blocks per request), ids, positions, slots of one step."""
    g = torch.Generator().manual_seed(seed)
    bs = SPEC.block_size
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    qo, tables, pos, slots = [0], [], [], []
    for q_len, kv_len in zip(q_lens, kv_lens):
        n = -(-kv_len // bs)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        qo.append(qo[-1] + q_len)
        for p in range(kv_len - q_len, kv_len):
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
    ids = torch.randint(0, VOCAB, (qo[-1],), generator=g)
    return qo, list(kv_lens), tables, ids, torch.tensor(pos), torch.tensor(slots)


@pytest.fixture(scope="module")
def setup():
    from tokenbudget.engine.worker.cuda_graphs import CUDAGraphRunner
    from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend

    dev = torch.device("cuda")
    model = ToyModel(dev)
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(NUM_BLOCKS, 2, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim,
                          generator=g).to(dev, SPEC.dtype) for _ in range(LAYERS)]
    backend = FlashInferBackend(SPEC, dev)
    runner = CUDAGraphRunner(model, caches, backend, batch_sizes=(1, 2, 4), draft_lens=(0, 2),
                             max_pages_per_req=MAX_POS // SPEC.block_size)
    runner.capture()
    return model, caches, backend, runner


def _compare(setup, q_lens, kv_lens, seed, exact):
    model, caches, backend, runner = setup
    qo, kv, tables, ids, pos, slots = _step(q_lens, kv_lens, seed)
    dev = backend.device
    ids, pos, slots = ids.to(dev), pos.to(dev), slots.to(dev)
    snapshot = [c.clone() for c in caches]
    eager_caches = [c.clone() for c in caches]
    md = backend.build_metadata(qo, kv, tables, slots)
    want = model(ids, pos, md, eager_caches).clone()
    md = backend.build_metadata(qo, kv, tables, slots)
    got = runner(ids, pos, md, caches).clone()
    for c, s in zip(caches, snapshot):  # restore for the next case
        c.copy_(s)
    if exact:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    return got


def test_decode_replay_matches_eager(setup):
    assert setup[3]._bucket_for([0, 1, 2, 3]) is setup[3].graphs[(4, 1)]
    _compare(setup, [1, 1, 1], [9, 40, 77], seed=1, exact=False)   # padded 3 -> 4
    _compare(setup, [1], [130], seed=2, exact=False)


def test_verify_replay_matches_eager(setup):
    assert setup[3]._bucket_for([0, 3, 6]) is setup[3].graphs[(2, 3)]
    _compare(setup, [3, 3], [3, 50], seed=3, exact=False)
    _compare(setup, [3, 3, 3], [20, 33, 100], seed=4, exact=False)  # padded 3 -> 4


def test_replay_twice_is_deterministic(setup):
    a = _compare(setup, [1, 1], [12, 60], seed=5, exact=False)
    b = _compare(setup, [1, 1], [12, 60], seed=5, exact=False)
    assert torch.equal(a, b)


def test_unbucketed_batches_run_eagerly(setup):
    runner = setup[3]
    assert runner._bucket_for([0, 5, 6]) is None        # prefill chunk + decode
    assert runner._bucket_for([0, 2, 4]) is None        # k = 1 was not captured
    assert runner._bucket_for([0] + list(range(1, 6))) is None  # 5 requests > 4
    _compare(setup, [5, 1], [5, 30], seed=6, exact=True)
