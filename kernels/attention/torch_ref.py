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

* every GEMM has EXACTLY ``ROW_PAD`` = 4 rows: a BLAS picks its kernel (and so a row's
  summation order) from the GEMM's row count M (MKL's optimized paths on this CPU have M=1 |
  M in {2,3} | M >= 4; its portable path, ``MKL_CBWR=COMPATIBLE``, changes a row's bits for
  every M; issue 26 saw an 8B-layout GQA-4 decode differ from its 5-row verify), so a
  request's rows are cut into 4-row blocks and each block is its own GEMM (a batch entry of
  ``bmm``: over the heads when the request has few blocks, over the blocks of one head through a
  stride-0 expand of its keys when it has many). GQA groups the G query heads of a kv head into
  the rows, position-major: M = round_up(G * q_len, 4). The one assumption left: a 4-row GEMM
  gives a row the same bits at any of its 4 offsets (true of MKL's optimized and portable
  paths, ``tests/test_attention_row_blocks.py``). Cost: a verify or a prefill chunk issues many
  small GEMMs; a decode is one block as before (``benches/torch_ref_row_blocks.py``, figures in
  benches/RESULTS.md; the quantized default model's C forward does not use this backend);
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

Cost (the CPU decode path runs this 30 times a token on the default model): everything that does
not depend on the layer is built once per step in :meth:`build_metadata` -- the flat cache rows
of each request's keys, the additive causal mask (0 / -inf), zero-padded fp32 work buffers laid
out ``[Hk, np, D]`` / ``[Hk, np, D + 1]`` with the ones column already set -- so a layer only
gathers its keys and values into the buffers (the padding stays zero), scores in 4-row GEMMs
(then scale and mask, elementwise), and does max / exp / the P @ [V | 1] GEMMs per key tile.
The G query heads of a kv head share its GEMM rows position-major (``M = round_up(G * q_len,
4)``), so a decode scores 4 rows, not 4 G. Tried and dropped: attending all one-token requests
of a step in one batched GEMM set (bitwise the same rows, but no faster: the gather of the
context dominates). Figures:
benches/RESULTS.md, "Figures behind decisions in the source".
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
class _Tile:
    """Query rows ``[r0, r1)`` of a request, laid out position-major: GEMM row ``r * G + gi`` is
    query head ``gi`` of the kv head's group at position ``r0 + r``; rows padded to ``M``."""

    r0: int
    r1: int
    qbuf: torch.Tensor     # [Hk, M, D] fp32, padding rows zero; M = round_up(G * (r1 - r0), 4)
    # window -> [M, np] fp32: 0 where the key is visible, -inf elsewhere. Kept for the step for a
    # request of one tile (decodes, verifies, chunks <= Q_TILE: the hot path), one per window the
    # layers use (0: the full causal mask); None for a longer prefill, whose tiles build it per
    # layer (M x np per tile instead of q_len x np held for the step).
    biases: dict[int, torch.Tensor] | None


@dataclass(slots=True)
class _ReqPlan:
    """One request's layer-independent attention state, reused by every layer of the step."""

    q_start: int
    q_len: int
    kv_len: int
    k_rows: torch.Tensor   # [kv_len] int64: rows of the flat cache view holding its keys
    kbuf: torch.Tensor     # [Hk, np, D] fp32, keys past kv_len zero
    vbuf: torch.Tensor     # [Hk, np, D + 1] fp32, [..., :kv_len, D] = 1, rest of the padding zero
    tiles: list[_Tile]


@dataclass(slots=True)
class TorchRefData:
    plans: list[_ReqPlan]
    write_rows: torch.Tensor  # [num_tokens] int64: flat cache-view rows of the new tokens' keys


def _flat(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, 2, block_size, Hk, D]`` -> ``[num_blocks * 2 * block_size, Hk, D]``: the key
    of slot (b, o) is row ``(2 b) * block_size + o``, its value ``block_size`` rows further."""
    return kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def _cache_rows(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows of :func:`_flat` holding the keys at (block id, offset)."""
        return blocks * (2 * self.spec.block_size) + offsets

    def build_metadata(self, qo_indptr: list[int], kv_lens: list[int],
                       block_tables: list[list[int]], slot_mapping: torch.Tensor) -> AttentionMetadata:
        """Checks the inputs now; the per-request plans (key rows, buffers, masks) are built by the
        first ``write_kv`` or ``attend`` of the step (``_data``): a model forward that attends
        itself (the C decoder forward) never calls either, and must not pay ~1 MB of zeroed
        buffers per step for a plan it does not use."""
        check_metadata_inputs(qo_indptr, kv_lens, block_tables, self.spec.block_size)
        num_tokens = qo_indptr[-1]
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, expected {num_tokens}")
        slots = slot_mapping.to(device=self.device, dtype=torch.long)
        return AttentionMetadata(list(qo_indptr), list(kv_lens), block_tables, slots, num_tokens, None, self)

    def _data(self, md: AttentionMetadata) -> TorchRefData:
        """The step's plans, built once (``build_metadata``)."""
        if md.backend_data is None:
            md.backend_data = self._plan(md)
        return md.backend_data

    def _plan(self, md: AttentionMetadata) -> TorchRefData:
        bs, dev = self.spec.block_size, self.device
        hk, d = self.spec.num_kv_heads, self.spec.head_dim
        plans = []
        for b, kv_len in enumerate(md.kv_lens):
            q_start, q_len = md.qo_indptr[b], md.qo_indptr[b + 1] - md.qo_indptr[b]
            np_ = padded_kv_len(kv_len)
            pos = torch.arange(kv_len, device=dev)
            blocks = torch.tensor(md.block_tables[b][:-(-kv_len // bs)], dtype=torch.long, device=dev)
            k_rows = self._cache_rows(blocks[pos // bs], pos % bs)
            vbuf = torch.zeros(hk, np_, d + 1, device=dev)
            vbuf[:, :kv_len, d] = 1.0
            tiles = [self._tile(r0, min(r0 + Q_TILE, q_len), q_len, kv_len, np_, q_len <= Q_TILE)
                     for r0 in range(0, q_len, Q_TILE)]
            plans.append(_ReqPlan(q_start, q_len, kv_len, k_rows, torch.zeros(hk, np_, d, device=dev), vbuf, tiles))
        slots = md.slot_mapping
        return TorchRefData(plans, self._cache_rows(torch.div(slots, bs, rounding_mode="floor"), slots % bs))

    def _tile(self, r0: int, r1: int, q_len: int, kv_len: int, np_: int, keep_bias: bool) -> _Tile:
        hk, d = self.spec.num_kv_heads, self.spec.head_dim
        m = _round_up(self.spec.num_heads // hk * (r1 - r0), ROW_PAD)
        return _Tile(r0, r1, torch.zeros(hk, m, d, device=self.device), {} if keep_bias else None)

    def _bias(self, r0: int, m: int, q_len: int, kv_len: int, np_: int, window: int) -> torch.Tensor:
        """``[m, np]``: 0 where GEMM row ``r * G + gi`` (position ``r0 + r``) sees the key, else -inf
        (causal; with ``window`` > 0 also only the last ``window`` keys up to the row's own)."""
        g, dev = self.spec.num_heads // self.spec.num_kv_heads, self.device
        i = (r0 + torch.arange(m, device=dev) // g).clamp_(max=q_len - 1).unsqueeze(1)  # padding: last row
        j = torch.arange(np_, device=dev).unsqueeze(0)
        last = i + (kv_len - q_len)  # the row's own position: its last visible key
        allowed = (j <= last) & (j < kv_len)
        if window:
            allowed &= j > last - window
        return torch.zeros(m, np_, device=dev).masked_fill_(~allowed, float("-inf"))

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        rows, n = self._data(metadata).write_rows, metadata.num_tokens
        flat = _flat(kv_cache)
        flat.index_copy_(0, rows, k[:n].to(kv_cache.dtype))
        flat.index_copy_(0, rows + self.spec.block_size, v[:n].to(kv_cache.dtype))

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        n = metadata.num_tokens
        out = torch.empty_like(q)
        out[n:].zero_()
        flat = _flat(kv_cache)
        for p in self._data(metadata).plans:
            out[p.q_start:p.q_start + p.q_len] = self._attend_one(q, flat, p, window, sinks)
        return out

    def _attend_one(self, q: torch.Tensor, flat: torch.Tensor, p: _ReqPlan, window: int,
                    sinks: torch.Tensor | None) -> torch.Tensor:
        hk, d, kv_len = self.spec.num_kv_heads, self.spec.head_dim, p.kv_len
        g = self.spec.num_heads // hk
        p.kbuf[:, :kv_len] = flat.index_select(0, p.k_rows).transpose(0, 1)
        p.vbuf[:, :kv_len, :d] = flat.index_select(0, p.k_rows + self.spec.block_size).transpose(0, 1)
        k_t = p.kbuf.transpose(1, 2)                          # [Hk, D, np]
        nt = p.kbuf.shape[1] // KEY_TILE
        v_tiles = p.vbuf.view(hk * nt, KEY_TILE, d + 1)       # tile t of head h: row h * nt + t
        outs = []
        for t in p.tiles:
            rows = t.r1 - t.r0
            qt = q[p.q_start + t.r0:p.q_start + t.r1].view(rows, hk, g, d)
            t.qbuf[:, :rows * g].view(hk, rows, g, d).copy_(qt.permute(1, 0, 2, 3))
            bias = t.biases.get(window) if t.biases is not None else None
            if bias is None:
                bias = self._bias(t.r0, t.qbuf.shape[1], p.q_len, kv_len, p.kbuf.shape[1], window)
                if t.biases is not None:
                    t.biases[window] = bias
            o = self._rows(t.qbuf, k_t, v_tiles, bias, nt, sinks)
            outs.append(o[:, :rows * g].view(hk, rows, g, d).permute(1, 0, 2, 3).reshape(rows, hk * g, d))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _rows(self, qg: torch.Tensor, k_t: torch.Tensor, v_tiles: torch.Tensor, bias: torch.Tensor,
              nt: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``qg [Hk, M, D]`` -> ``[Hk, M, D]``: softmax(scale q k^T + bias) @ V, the denominator from
        the ones column of V (same GEMM), key tiles summed in order. Every GEMM has 4 rows. With
        ``sinks`` each row's max and denominator also count its head's sink logit."""
        hk, m, d = qg.shape
        s = _bmm_row_blocks(qg, k_t).mul_(self.spec.softmax_scale)   # [Hk, M, np]
        if (cap := self.spec.logits_soft_cap) is not None:  # HF's order: scale, / cap, tanh, * cap, mask
            s = s.div_(cap).tanh_().mul_(cap)
        s = s.add_(bias)
        top = s.amax(-1, keepdim=True)
        if sinks is not None:  # GEMM row j of kv head h is query head h * G + j % G
            g = self.spec.num_heads // hk
            sink = sinks.float().view(hk, g)[:, torch.arange(m, device=s.device) % g].unsqueeze(-1)  # [Hk, M, 1]
            top = torch.maximum(top, sink)
        s = s.sub_(top).exp_()
        if nt == 1:
            acc = _bmm_row_blocks(s, v_tiles)
        else:
            pt = s.view(hk, m, nt, KEY_TILE).permute(0, 2, 1, 3).reshape(hk * nt, m, KEY_TILE)
            o = _bmm_row_blocks(pt, v_tiles).view(hk, nt, m, d + 1)
            acc = o[:, 0]
            for t in range(1, nt):
                acc = acc + o[:, t]
        denom = acc[..., d:] if sinks is None else acc[..., d:] + (sink - top).exp()
        return acc[..., :d] / denom


def _bmm_row_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [Bt, M, K] @ b [Bt, K, N]`` as GEMMs of exactly ``ROW_PAD`` rows each (M a multiple of
    it), so a row's bits never depend on how many rows share its request: fewer Python-level calls
    either way (one ``bmm`` per row block, batched over ``Bt``; or one per batch entry, its row
    blocks batched over a stride-0 expand of ``b``)."""
    bt, m, k = a.shape
    n, nb = b.shape[-1], m // ROW_PAD
    out = torch.empty(bt, m, n, dtype=a.dtype, device=a.device)
    if nb <= bt:
        for j in range(nb):
            rows = slice(j * ROW_PAD, (j + 1) * ROW_PAD)
            out[:, rows] = torch.bmm(a[:, rows], b)
    else:
        a = a.contiguous()
        for i in range(bt):
            out[i] = torch.bmm(a[i].view(nb, ROW_PAD, k), b[i].expand(nb, k, n)).view(m, n)
    return out
