"""A CPU stand-in for ``flashinfer`` 0.6.18.post1's two paged-KV wrappers (torch math inside).

Same constructor, ``plan()`` and ``run()`` signatures as ``BatchPrefillWithPagedKVCacheWrapper``
and ``BatchDecodeWithPagedKVCacheWrapper`` (flashinfer/prefill.py, flashinfer/decode.py), and the
same host-side planning decisions as ``include/flashinfer/attention/scheduler.cuh``
(``PrefillSplitQOKVIndptr``, ``FA2DetermineCtaTileQ``, ``PrefillBinarySearchKVChunkSize``), so
the backend's bookkeeping (which wrapper plans which rows, with which tile and KV split, how
much float workspace a plan needs, CUDA-graph buffers read at run time) can be checked without a
GPU. What it cannot show: the real kernels' bits and speed.

Int workspace modelled (flashinfer issue #4002): ``plan()`` writes one scheduler entry (request
index) per REAL work tile into the page-locked int workspace, then copies the region of the
PADDED grid (``padded_batch_size`` entries; graph mode pads to ``max(2 * #SM / num_kv_heads,
tiles)``) to the device; the padding CTAs read whatever that memory held. The real wrappers
allocate both buffers with ``torch.empty`` and torch's pinned-memory cache hands back buffers of
earlier wrappers, so the stand-in fills them with ``0x01`` bytes (request index 16843009, one of
the values reproduced) and ``run()`` raises where a real kernel would read out of range.

Numerics modelled: a split KV is computed chunk by chunk and merged through the log-sum-exp
(as ``merge_states`` does), so a row's bits depend on its plan's chunk size exactly where the
real kernels' do. Every plan is recorded in ``wrapper.plans`` (``PlanRecord``).

Use: ``FlashInferBackend(spec, "cpu", flashinfer=flashinfer_standin)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

NUM_SMS = 132  # an H100 SXM; max_grid_size = 2 * NUM_SMS as in PrefillPlan
INT_WORKSPACE_BYTES = 1 << 20  # the real wrappers take 8 MiB; 1 MiB holds every plan tested here
RECYCLED_BYTE = 1  # what a recycled pinned buffer holds in the stand-in (0x01010101 per int32)

plan_calls = 0  # every plan() on any wrapper (tests reset it)


@dataclass(frozen=True)
class PlanRecord:
    kernel: str            # "prefill" | "decode_tc" | "decode_cuda_core"
    cuda_graph: bool
    cta_tile_q: int
    split_kv: bool
    kv_chunk_tokens: int   # 0 = one chunk per request
    float_workspace: int   # bytes of split-KV scratch this plan needs


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cta_tile_q(packed_qo_len: int, head_dim: int) -> int:
    """``FA2DetermineCtaTileQ`` for head_dim < 256 on sm_80+."""
    if packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if packed_qo_len > 16 else 16


def _binary_search_chunk(graph: bool, max_bs_if_split: int, packed: list[int], kv_pages: list[int],
                         tile: int, min_chunk: int) -> tuple[bool, int]:
    max_kv = max([1] + kv_pages)
    low, high = min_chunk, max_kv
    while low < high:
        mid = (low + high) // 2
        n = sum(_cdiv(p, tile) * _cdiv(max(k, 1), mid) for p, k in zip(packed, kv_pages))
        if n > max_bs_if_split:
            low = mid + 1
        else:
            high = mid
    return graph or low < max_kv, low


def plan_split(qo_lens: list[int], kv_pages: list[int], num_qo_heads: int, num_kv_heads: int,
               head_dim: int, page_size: int, graph: bool, uniform_q_len: int,
               fixed_split_size: int, disable_split_kv: bool) -> tuple[int, bool, int, int, list[int]]:
    """``PrefillSplitQOKVIndptr``: (cta_tile_q, split_kv, kv_chunk_pages, padded_batch_size,
    request_indices): one request index per real work tile (``new_batch_size`` of them)."""
    g = num_qo_heads // num_kv_heads
    b = len(qo_lens)
    packed = [q * g for q in qo_lens]
    max_bs_if_split = 2 * NUM_SMS // num_kv_heads
    if graph and uniform_q_len > 0:
        tile = cta_tile_q(uniform_q_len * g, head_dim)
        total_tiles = b * _cdiv(uniform_q_len * g, tile)
    elif graph:
        t = sum(qo_lens)
        tile = cta_tile_q((t - b + 1) * g, head_dim)
        total_tiles = _cdiv(t * g, tile) + b - 1
    else:
        tile = cta_tile_q(sum(packed) // b, head_dim)
        total_tiles = sum(_cdiv(p, tile) for p in packed)
    split = False
    if disable_split_kv:
        chunk = 1 << 62
    elif fixed_split_size > 0:
        chunk = fixed_split_size
    else:
        split, chunk = _binary_search_chunk(graph, max_bs_if_split, packed, kv_pages, tile,
                                            max(128 // page_size, 1))
    request_indices = []
    for r, (p, k) in enumerate(zip(packed, kv_pages)):
        chunks = 1 if disable_split_kv else _cdiv(max(k, 1), chunk)
        if fixed_split_size > 0 and not disable_split_kv:
            split = split or chunks > 1
        request_indices += [r] * (_cdiv(p, tile) * chunks)
    new_bs = len(request_indices)
    padded = max(max_bs_if_split, total_tiles) if graph else new_bs
    if new_bs > padded:
        raise RuntimeError("new batch size should not exceed padded batch size")
    return tile, split, chunk, padded, request_indices


def _attend(q, k_cache, v_cache, qo, kv_indptr, kv_indices, last_len, page_size, scale, chunk):
    """Bottom-right causal attention, one query row at a time (so a row's bits never depend on
    how many rows share its request), its keys split into ``chunk``-token pieces merged through
    the log-sum-exp (``chunk`` 0: one piece)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    hk = k_cache.shape[2]
    g = q.shape[1] // hk
    for b in range(len(qo) - 1):
        q0, q1 = int(qo[b]), int(qo[b + 1])
        pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        kv_len = (len(pages) - 1) * page_size + int(last_len[b])
        k = k_cache[pages].reshape(-1, hk, k_cache.shape[-1])[:kv_len].float().repeat_interleave(g, 1)
        v = v_cache[pages].reshape(-1, hk, v_cache.shape[-1])[:kv_len].float().repeat_interleave(g, 1)
        for i in range(q1 - q0):
            n = kv_len - (q1 - q0) + i + 1           # keys this row sees
            qi = q[q0 + i].float()                   # [H, D]
            step = chunk or n
            outs, lses = [], []
            for c0 in range(0, n, step):
                kc, vc = k[c0:min(n, c0 + step)], v[c0:min(n, c0 + step)]
                s = torch.einsum("hd,khd->hk", qi, kc) * scale
                m = s.amax(-1, keepdim=True)
                p = torch.exp(s - m)
                den = p.sum(-1, keepdim=True)
                outs.append(torch.einsum("hk,khd->hd", p, vc) / den)
                lses.append(m + torch.log(den))
            if len(outs) == 1:
                out[q0 + i] = outs[0]
            else:
                lse = torch.stack(lses)
                w = torch.exp(lse - lse.amax(0, keepdim=True))
                out[q0 + i] = (torch.stack(outs) * w).sum(0) / w.sum(0)
    return out


class _Wrapper:
    kernel = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str, use_cuda_graph: bool,
                 backend: str) -> None:
        if kv_layout != "NHD":
            raise NotImplementedError("stand-in: NHD only")
        self._float_workspace_buffer = float_workspace_buffer
        self._use_cuda_graph = use_cuda_graph
        self._backend = backend
        self.plans: list[PlanRecord] = []
        # torch.empty in the real wrappers; recycled pinned memory holds earlier wrappers' data
        self._int_workspace_buffer = torch.full((INT_WORKSPACE_BYTES,), RECYCLED_BYTE, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.full((INT_WORKSPACE_BYTES,), RECYCLED_BYTE,
                                                           dtype=torch.uint8)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor,
                               int_workspace_buffer: torch.Tensor) -> None:
        self._float_workspace_buffer = float_workspace_buffer

    def _store(self, name: str, value: torch.Tensor) -> None:
        buf = getattr(self, name)
        if self._use_cuda_graph:
            if value.numel() > buf.numel():
                raise ValueError(f"{name}: {value.numel()} entries exceed the cuda-graph buffer")
            buf[:value.numel()].copy_(value)
        else:
            setattr(self, name, value.clone())

    def _plan_common(self, qo_lens, kv_indptr, num_qo_heads, num_kv_heads, head_dim, page_size,
                     sm_scale, uniform_q_len, fixed_split_size, disable_split_kv) -> None:
        global plan_calls
        plan_calls += 1
        kv_pages = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        tile, split, chunk, padded, request_indices = plan_split(
            qo_lens, kv_pages, num_qo_heads, num_kv_heads, head_dim, page_size,
            self._use_cuda_graph, uniform_q_len, fixed_split_size or -1, disable_split_kv)
        # scheduler entries: the real tiles' into page-locked memory, then the padded grid's
        # region to the device (PrefillPlan: std::copy of the real entries, one async copy)
        pinned = self._pin_memory_int_workspace_buffer.view(torch.int32)
        pinned[:len(request_indices)] = torch.tensor(request_indices, dtype=torch.int32)
        self._int_workspace_buffer.view(torch.int32)[:padded] = pinned[:padded]
        self._grid, self._num_reqs = padded, len(qo_lens)
        need = 0
        if split:
            tmp_v = num_qo_heads * padded * tile * head_dim * 4
            need = _cdiv(tmp_v, 16) * 16 + num_qo_heads * padded * tile * 4
            have = self._float_workspace_buffer.numel() * self._float_workspace_buffer.element_size()
            if tmp_v > have:
                raise RuntimeError(f"Buffer overflow when allocating memory for batch_prefill_tmp_v "
                                   f"with size {tmp_v} and alignment 16, but only {have} bytes available")
        self.plans.append(PlanRecord(self.kernel, self._use_cuda_graph, tile, split,
                                     chunk * page_size if split else 0, need))
        self._chunk = chunk * page_size if split else 0
        self._page_size, self._scale = page_size, sm_scale or head_dim ** -0.5

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, *args: Any, q_scale=None,
            k_scale=None, v_scale=None, out: torch.Tensor | None = None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None,
            **kwargs: Any) -> torch.Tensor:
        if not self.plans:
            raise RuntimeError("run() before plan()")
        req = self._int_workspace_buffer.view(torch.int32)[:self._grid]
        wild = ((req < 0) | (req >= self._num_reqs)).nonzero()
        if len(wild):
            cta = int(wild[0])
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered (stand-in: "
                               f"CTA {cta} of {self._grid} reads request index {int(req[cta])} of "
                               f"{self._num_reqs}, left in the int workspace)")
        res = _attend(q, paged_kv_cache[:, 0], paged_kv_cache[:, 1], self._qo_indptr_buf,
                      self._paged_kv_indptr_buf, self._paged_kv_indices_buf,
                      self._paged_kv_last_page_len_buf, self._page_size, self._scale, self._chunk)
        self.last_out = out  # tests check the backend writes in place (no extra output tensor)
        if out is None:
            return res.to(q.dtype)
        out.copy_(res)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend)
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale=None,
             window_left: int = -1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking: bool = True,
             prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0,
             max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None,
             disable_split_kv: bool = False) -> None:
        if not causal:
            raise NotImplementedError("stand-in: causal only")
        for name, t in (("_qo_indptr_buf", qo_indptr), ("_paged_kv_indptr_buf", paged_kv_indptr),
                        ("_paged_kv_indices_buf", paged_kv_indices),
                        ("_paged_kv_last_page_len_buf", paged_kv_last_page_len)):
            self._store(name, t)
        qo = qo_indptr.tolist()
        self._plan_common([b - a for a, b in itertools.pairwise(qo)], paged_kv_indptr, num_qo_heads,
                          num_kv_heads, head_dim_qk, page_size, sm_scale, 0, fixed_split_size,
                          disable_split_kv)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 backend: str = "auto", jit_args=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend)
        self.use_tensor_cores = use_tensor_cores
        self.kernel = "decode_tc" if use_tensor_cores else "decode_cuda_core"
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        if use_cuda_graph:
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            self._qo_indptr_buf = torch.arange(self._fixed_batch_size + 1, dtype=torch.int32)
        self._q_len_per_req = None

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
             window_left: int = -1, window_right: int = 0, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None,
             sm_scale=None, rope_scale=None, rope_theta=None, non_blocking: bool = True,
             block_tables=None, seq_lens=None, fixed_split_size=None,
             disable_split_kv: bool = False, q_len_per_req: int = 1) -> None:
        batch = len(last_page_len)
        if q_len_per_req > 1 and not self.use_tensor_cores:
            raise ValueError("q_len_per_req > 1 requires tensor-core decode")
        if fixed_split_size is not None and not self.use_tensor_cores:
            raise ValueError("fixed_split_size is only supported by tensor core decode for now.")
        if self._use_cuda_graph:
            if self._q_len_per_req not in (None, q_len_per_req):
                raise ValueError("q_len_per_req is part of the frozen cudagraph shape")
            if batch != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            self._qo_indptr_buf.copy_(torch.arange(batch + 1, dtype=torch.int32) * q_len_per_req)
        else:
            self._qo_indptr_buf = torch.arange(batch + 1, dtype=torch.int32) * q_len_per_req
        for name, t in (("_paged_kv_indptr_buf", indptr), ("_paged_kv_indices_buf", indices),
                        ("_paged_kv_last_page_len_buf", last_page_len)):
            self._store(name, t)
        kv_lens = [(b - a - 1) * page_size + int(n) for a, b, n in
                   zip(indptr.tolist(), indptr.tolist()[1:], last_page_len.tolist())]
        if q_len_per_req > 1 and min(kv_lens) < q_len_per_req:
            raise ValueError(f"q_len_per_req={q_len_per_req} requires kv_len >= q_len_per_req")
        self._q_len_per_req = q_len_per_req
        # CUDA-core decode (DecodePlan) takes no disable_split_kv: it splits as it likes.
        no_split = disable_split_kv if self.use_tensor_cores else False
        self._plan_common([q_len_per_req] * batch, indptr, num_qo_heads, num_kv_heads, head_dim,
                          page_size, sm_scale, q_len_per_req if q_len_per_req > 1 else 0,
                          fixed_split_size, no_split)

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, *args: Any, **kwargs: Any):
        want = len(self._paged_kv_last_page_len_buf) * self._q_len_per_req
        if q.shape[0] != want:
            raise ValueError(f"q has {q.shape[0]} rows, the plan expects {want}")
        return super().run(q, paged_kv_cache, *args, **kwargs)


__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "PlanRecord", "cta_tile_q", "plan_split"]
