"""Attention-level parts of ``benches/gpu_check.py``: the backend vs torch_ref on mixed/decode/
verify batches, and the row-invariance table (decode vs verify, alone vs in a mixed batch).

The backend is whatever the selector gives on the device (FlashInfer on a GPU, torch_ref on
CPU), so the same code checks the real kernels on a GPU and its own plumbing on CPU.
"""

from __future__ import annotations

import torch

from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.attention.selector import select_attention_backend
from tokenbudget.kernels.attention.torch_ref import TorchRefBackend
from tokenbudget.kernels.kv_write import write_kv_reference


class Pool:
    """One paged KV cache with random contents and a block allocator for synthetic requests."""

    def __init__(self, spec: AttentionSpec, num_blocks: int, device, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.spec, self.device, self.g = spec, device, g
        self.cache = (torch.randn(num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim,
                                  generator=g) * 0.5).to(device, spec.dtype)
        self.next = 0

    def request(self, kv_len: int) -> list[int]:
        n = -(-kv_len // self.spec.block_size) + 1
        if self.next + n > self.cache.shape[0]:
            raise ValueError("KV pool too small for this check")
        table = list(range(self.next, self.next + n))
        self.next += n
        return table

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g).to(self.device, self.spec.dtype)


def slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions ``start .. end - 1`` of a request with page table ``table``."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def run_batch(backend, pool: Pool, reqs: list[tuple[int, int, list[int]]], q: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``reqs``: (q_len, kv_len, table). Writes the new K/V into a copy of the pool's cache."""
    bs = pool.spec.block_size
    qo, kv, tables, new = [0], [], [], []
    for q_len, kv_len, table in reqs:
        qo.append(qo[-1] + q_len)
        kv.append(kv_len)
        tables.append(table)
        new += slots(table, kv_len - q_len, kv_len, bs)
    slot_t = torch.tensor(new, dtype=torch.long, device=pool.device)
    md = backend.build_metadata(qo, kv, tables, slot_t)
    cache = pool.cache.clone()
    write_kv_reference(k, v, cache, slot_t)
    return backend.attend(q, cache, md)


def backend_vs_reference(spec: AttentionSpec, device, seed: int = 0) -> list[dict]:
    """Max |backend - torch_ref| on a mixed, a decode and a verify batch."""
    batches = {"mixed": ([37, 20, 4, 1, 3], [37, 50, 29, 17, 40]),
               "decode": ([1, 1, 1, 1], [1, 33, 16, 70]),
               "verify": ([4, 4, 4], [4, 31, 64])}
    backend = select_attention_backend(device, spec)
    ref = TorchRefBackend(spec, device)
    rows = []
    for name, (q_lens, kv_lens) in batches.items():
        pool = Pool(spec, sum(-(-n // spec.block_size) + 1 for n in kv_lens), device, seed)
        reqs = [(ql, kl, pool.request(kl)) for ql, kl in zip(q_lens, kv_lens)]
        t = sum(q_lens)
        q = pool.rand(t, spec.num_heads, spec.head_dim)
        k, v = pool.rand(t, spec.num_kv_heads, spec.head_dim), pool.rand(t, spec.num_kv_heads, spec.head_dim)
        got, want = run_batch(backend, pool, reqs, q, k, v), run_batch(ref, pool, reqs, q, k, v)
        err = (got.float() - want.float()).abs().max().item()
        rows.append({"batch": name, "backend": backend.name, "max_abs_err": err, "ok": err < 2e-2})
    return rows


def row_invariance(spec: AttentionSpec, device, ks: list[int], contexts: list[int],
                   deterministic: bool, seed: int = 0, aligned: bool = False) -> list[dict]:
    """For each (k, context): every row of a (1 + k)-token verify ending at position ``context``
    vs a 1-token decode of the same position, and that verify alone vs inside a
    mixed batch (a prefill chunk and two decodes next to it). Bitwise comparisons. ``aligned``:
    tiles aligned to the longest verify (``align_tiles(1 + max(ks))``, what the engine's wiring
    does when a speculator is configured)."""
    backend = select_attention_backend(device, spec, deterministic=deterministic)
    if aligned:
        backend.align_tiles(1 + max(ks))
    rows = []
    for c in contexts:
        for k in ks:
            blocks = 2 * (-(-(c + 64) // spec.block_size) + 1) + 64
            pool = Pool(spec, blocks, device, seed + c + k)
            table = pool.request(c)
            h, hk, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
            q, kk, vv = pool.rand(1 + k, h, d), pool.rand(1 + k, hk, d), pool.rand(1 + k, hk, d)
            # the verify covers positions c-k .. c; its row 0 is the decode of position c-k
            verify = run_batch(backend, pool, [(1 + k, c + 1, table)], q, kk, vv)
            # row j of the verify against a decode of its position c-k+j (an accepted draft's
            # successor is sampled from a row j > 0), over the K/V rows the verify wrote
            write_kv_reference(kk, vv, pool.cache,
                               torch.tensor(slots(table, c - k, c + 1, spec.block_size), device=pool.device))
            decode = torch.cat([run_batch(backend, pool, [(1, c - k + j + 1, table)], q[j:j + 1], kk[j:j + 1],
                                          vv[j:j + 1]) for j in range(1 + k)])
            others = [(64, 64, pool.request(64)), (1, 300, pool.request(300)), (1, 40, pool.request(40))]
            extra_q = pool.rand(66, h, d)
            extra_k, extra_v = pool.rand(66, hk, d), pool.rand(66, hk, d)
            mixed = run_batch(backend, pool, [others[0], (1 + k, c + 1, table), *others[1:]],
                              torch.cat([extra_q[:64], q, extra_q[64:]]),
                              torch.cat([extra_k[:64], kk, extra_k[64:]]),
                              torch.cat([extra_v[:64], vv, extra_v[64:]]))[64:65 + k]
            rows.append({"deterministic": deterministic, "aligned": aligned or deterministic, "k": k,
                         "context": c,
                         "unequal_verify_rows": [j for j in range(1 + k) if not torch.equal(decode[j], verify[j])],
                         "verify_alone_eq_mixed": bool(torch.equal(verify, mixed)),
                         "max_abs_diff": max((decode - verify).abs().max().item(),
                                             (verify - mixed).abs().max().item())})
    return rows


def batched_row_invariance(spec: AttentionSpec, device, ks: list[int], contexts: list[int],
                           deterministic: bool, seed: int = 0) -> list[dict]:
    """The engine's shape of the same question: ``len(contexts)`` requests verifying together
    (request i a (1 + k)-row verify ending at position ``contexts[i]``) against the same requests
    decoding together, one row each, at every verify position. Page tables are scattered and
    exactly as long as each request's K/V (the padded plan reaches pages a request does not own).
    Tiles aligned as the wiring aligns them. One row per k: the (request, row) pairs that differ."""
    backend = select_attention_backend(device, spec, deterministic=deterministic)
    backend.align_tiles(1 + max(ks))
    bs, h, hk, d = spec.block_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    rows = []
    for k in ks:
        need = [-(-(c + 1) // bs) for c in contexts]
        pool = Pool(spec, sum(need) + 1, device, seed + k)
        order = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed + k)) + 1  # block 0 unowned
        tables, at = [], 0
        for n in need:
            tables.append(order[at:at + n].tolist())
            at += n
        q, kk, vv = pool.rand(len(contexts), 1 + k, h, d), pool.rand(len(contexts), 1 + k, hk, d), \
            pool.rand(len(contexts), 1 + k, hk, d)
        verify = run_batch(backend, pool, [(1 + k, c + 1, t) for c, t in zip(contexts, tables)],
                           q.flatten(0, 1), kk.flatten(0, 1), vv.flatten(0, 1)).view(len(contexts), 1 + k, h, d)
        written = [s for c, t in zip(contexts, tables) for s in slots(t, c - k, c + 1, bs)]
        write_kv_reference(kk.flatten(0, 1), vv.flatten(0, 1), pool.cache, torch.tensor(written, device=pool.device))
        unequal = []
        for j in range(1 + k):
            decode = run_batch(backend, pool, [(1, c - k + j + 1, t) for c, t in zip(contexts, tables)],
                               q[:, j], kk[:, j], vv[:, j])
            unequal += [[i, j] for i in range(len(contexts)) if not torch.equal(decode[i], verify[i, j])]
        rows.append({"deterministic": deterministic, "k": k, "contexts": list(contexts), "unequal": unequal})
    return rows


__all__ = ["Pool", "backend_vs_reference", "batched_row_invariance", "row_invariance", "run_batch", "slots"]
