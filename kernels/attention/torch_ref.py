"""Torch reference attention backend (CPU; also runs on CUDA, slowly).

Per request: gather its pages, then attention with an explicit BOTTOM-RIGHT causal mask
(``F.scaled_dot_product_attention(is_causal=True)`` is top-left aligned: wrong when
q_len < kv_len).

Batch invariance (see ``tests/test_batch_invariance.py`` and ``engine/model/llama.py``): a query
row's output must not depend on how many query rows share its request chunk, on the request's
kv length past the row's causal limit, nor on the other requests in the batch. SDPA is not
invariant on this CPU (fp32: 92 of 96 rows of a chunk differ bitwise from the same rows decoded
one at a time). So attention is written out with plain ``bmm`` calls whose shapes are made
invariant:

* query rows are padded to a multiple of 4 (MKL sgemm has three row paths: M=1 gemv, M in
  {2,3}, M>=4; with 2 threads rows are split between threads, so M must also be a multiple of 4);
  GQA groups the G query heads of a kv head into the M dimension: M = G * round_up(q_len, 4);
* keys are padded to ``np``, a multiple of 256, and masked to -inf (MKL's narrow-N kernels,
  N < 8, differ; a score element is otherwise the same dot product whatever ``np``);
* softmax weights are ``exp(s - rowmax)`` (max is order independent; masked weights are exact
  zeros) and the denominator comes out of the SAME gemm as the numerator through a ones column
  appended to V (no separate sum reduction whose order would depend on the length);
* the P @ V reduction runs in key tiles of EXACTLY 256 (MKL's K-blocking depends on K: a K=192
  GEMM and a K=256 GEMM with zero tail differ bitwise), tiles summed in order 0, 1, 2, ...;
  tiles past a row's causal limit add exact zeros. Cost: a short-context decode still scores
  256 keys (negligible next to the linear layers).

Math is done in fp32 whatever the cache dtype (bf16 inputs are upcast).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbudget.kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    check_metadata_inputs,
)

ROW_PAD = 4      # query rows per request padded to a multiple of this
KEY_TILE = 256   # keys padded to a multiple of this; every P @ V GEMM has K == KEY_TILE
Q_TILE = 256     # query rows per score tile (memory bound on long prefills)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def padded_kv_len(kv_len: int) -> int:
    return _round_up(kv_len, KEY_TILE)


@dataclass(slots=True)
class _ReqPlan:
    q_start: int
    q_len: int
    kv_len: int
    np: int
    blocks: torch.Tensor   # [ceil(kv_len / block_size)] block ids, int64
    allowed: torch.Tensor  # [round_up(q_len, 4), np] bool, bottom-right causal & j < kv_len


@dataclass(slots=True)
class TorchRefData:
    plans: list[_ReqPlan]
    write_blk: torch.Tensor  # [num_tokens] int64
    write_off: torch.Tensor  # [num_tokens] int64


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def build_metadata(self, qo_indptr: list[int], kv_lens: list[int],
                       block_tables: list[list[int]], slot_mapping: torch.Tensor) -> AttentionMetadata:
        bs = self.spec.block_size
        check_metadata_inputs(qo_indptr, kv_lens, block_tables, bs)
        num_tokens = qo_indptr[-1]
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, expected {num_tokens}")
        dev = self.device
        slots = slot_mapping.to(device=dev, dtype=torch.long)
        plans = []
        for b, kv_len in enumerate(kv_lens):
            q_start, q_len = qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b]
            np_ = padded_kv_len(kv_len)
            mp = _round_up(q_len, ROW_PAD)
            i = torch.arange(mp, device=dev).unsqueeze(1)
            j = torch.arange(np_, device=dev).unsqueeze(0)
            allowed = (j <= i + (kv_len - q_len)) & (j < kv_len)
            nblk = -(-kv_len // bs)
            blocks = torch.tensor(block_tables[b][:nblk], dtype=torch.long, device=dev)
            plans.append(_ReqPlan(q_start, q_len, kv_len, np_, blocks, allowed))
        data = TorchRefData(plans, torch.div(slots, bs, rounding_mode="floor"), slots % bs)
        return AttentionMetadata(list(qo_indptr), list(kv_lens), block_tables, slots,
                                 num_tokens, data, self)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        d: TorchRefData = metadata.backend_data
        n = metadata.num_tokens
        kv_cache[d.write_blk, 0, d.write_off] = k[:n].to(kv_cache.dtype)
        kv_cache[d.write_blk, 1, d.write_off] = v[:n].to(kv_cache.dtype)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        out = q.new_zeros(q.shape)
        k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
        for p in metadata.backend_data.plans:
            out[p.q_start:p.q_start + p.q_len] = self._attend_one(q, k_cache, v_cache, p)
        return out

    def _attend_one(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    p: _ReqPlan) -> torch.Tensor:
        hk, d = self.spec.num_kv_heads, self.spec.head_dim
        kv_len, np_ = p.kv_len, p.np
        k = k_cache[p.blocks].view(-1, hk, d)[:kv_len]
        v = v_cache[p.blocks].view(-1, hk, d)[:kv_len]
        kp = torch.zeros(np_, hk, d, dtype=torch.float32, device=q.device)
        kp[:kv_len] = k
        vp = torch.zeros(np_, hk, d + 1, dtype=torch.float32, device=q.device)
        vp[:kv_len, :, :d] = v
        vp[:kv_len, :, d] = 1.0
        k_t = kp.permute(1, 2, 0)                       # [Hk, D, np]
        nt, tile = np_ // KEY_TILE, KEY_TILE
        v_tiles = vp.view(nt, tile, hk, d + 1).permute(2, 0, 1, 3).reshape(hk * nt, tile, d + 1)
        outs = []
        for r0 in range(0, p.q_len, Q_TILE):
            r1 = min(r0 + Q_TILE, p.q_len)
            outs.append(self._rows(q[p.q_start + r0:p.q_start + r1], k_t, v_tiles,
                                   p.allowed[r0:_round_up(r1, ROW_PAD)], nt, tile))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _rows(self, q: torch.Tensor, k_t: torch.Tensor, v_tiles: torch.Tensor,
              allowed: torch.Tensor, nt: int, tile: int) -> torch.Tensor:
        h, hk, d = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        g = h // hk
        ql, mp = q.shape[0], allowed.shape[0]
        qp = torch.zeros(mp, h, d, dtype=torch.float32, device=q.device)
        qp[:ql] = q
        qg = qp.view(mp, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * mp, d)
        s = torch.bmm(qg, k_t).mul_(self.spec.softmax_scale).view(hk, g, mp, -1)
        s.masked_fill_(~allowed, float("-inf"))
        s = s.sub_(s.amax(-1, keepdim=True)).exp_().view(hk, g * mp, nt, tile)
        if nt == 1:
            acc = torch.bmm(s.view(hk, g * mp, tile), v_tiles)
        else:
            pt = s.permute(0, 2, 1, 3).reshape(hk * nt, g * mp, tile)
            o = torch.bmm(pt, v_tiles).view(hk, nt, g * mp, d + 1)
            acc = o[:, 0]
            for t in range(1, nt):
                acc = acc + o[:, t]
        o = acc[..., :d] / acc[..., d:]
        return o.view(hk, g, mp, d).permute(2, 0, 1, 3).reshape(mp, h, d)[:ql]
