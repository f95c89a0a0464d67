"""Torch reference attention backend vs naive dense attention (mixed batch, random pages)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tokenbudget.kernels.attention import (
    AttentionSpec,
    TorchRefBackend,
    select_attention_backend,
)


def naive(q, k, v, scale):
    """q [ql, H, D], k/v [kl, Hk, D]; bottom-right causal; fp64."""
    ql, h, _ = q.shape
    kl, hk, _ = k.shape
    g = h // hk
    k = k.repeat_interleave(g, 1).double()
    v = v.repeat_interleave(g, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    mask = torch.ones(ql, kl, dtype=torch.bool).tril(kl - ql)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_against_dense(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    h, hk, d, bs, nb = 6, 2, 16, 4, 200
    spec = AttentionSpec(h, hk, d, bs)
    be = TorchRefBackend(spec)
    cache = torch.randn(nb, 2, bs, hk, d)  # stale garbage everywhere
    # (context already cached, new tokens): prefill chunk, verify, decode, fresh prompt, long ctx
    reqs = [(10, 7), (23, 4), (30, 1), (0, 9), (270, 3)]
    blocks = list(range(nb))
    rng.shuffle(blocks)
    tables, at = [], 0
    for c, n in reqs:
        m = -(-(c + n) // bs)
        tables.append(blocks[at:at + m])
        at += m
    full_k = [torch.randn(c + n, hk, d) for c, n in reqs]
    full_v = [torch.randn(c + n, hk, d) for c, n in reqs]
    for (c, _), t, kk, vv in zip(reqs, tables, full_k, full_v):  # pre-fill cached context
        for p in range(c):
            cache[t[p // bs], 0, p % bs] = kk[p]
            cache[t[p // bs], 1, p % bs] = vv[p]
    qo = [0]
    slots = []
    for (c, n), t in zip(reqs, tables):
        qo.append(qo[-1] + n)
        slots += [t[p // bs] * bs + p % bs for p in range(c, c + n)]
    md = be.build_metadata(qo, [c + n for c, n in reqs], tables, torch.tensor(slots))
    new_k = torch.cat([kk[c:] for (c, _), kk in zip(reqs, full_k)])
    new_v = torch.cat([vv[c:] for (c, _), vv in zip(reqs, full_v)])
    pad = 3  # padding rows past the real tokens are ignored / zero
    q = torch.randn(qo[-1] + pad, h, d)
    be.write_kv(torch.cat([new_k, torch.randn(pad, hk, d)]),
                torch.cat([new_v, torch.randn(pad, hk, d)]), cache, md)
    out = be.attend(q, cache, md)
    assert out.shape == q.shape and torch.all(out[qo[-1]:] == 0)
    for b, ((c, n), kk, vv) in enumerate(zip(reqs, full_k, full_v)):
        ref = naive(q[qo[b]:qo[b + 1]], kk, vv, 1 / math.sqrt(d))
        torch.testing.assert_close(out[qo[b]:qo[b + 1]].double(), ref, atol=1e-5, rtol=1e-5)


def test_bad_metadata_rejected():
    be = TorchRefBackend(AttentionSpec(2, 1, 8, 4))
    with pytest.raises(ValueError, match="q_len"):
        be.build_metadata([0, 5], [3], [[0]], torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="blocks"):
        be.build_metadata([0, 1], [9], [[0, 1]], torch.zeros(1, dtype=torch.long))


def test_selector_cpu_logs_backend(caplog):
    import logging
    with caplog.at_level(logging.INFO):
        be = select_attention_backend("cpu", AttentionSpec(2, 1, 8, 4))
    assert be.name == "torch_ref"
    assert any("attention backend: torch_ref" in r.getMessage() for r in caplog.records)
