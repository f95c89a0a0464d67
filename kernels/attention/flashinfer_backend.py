"""FlashInfer attention backend (CUDA), written against flashinfer-python 0.6.18.

Implements :class:`kernels.attention.base.AttentionBackend` over the same per-layer cache tensor
``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (FlashInfer's combined NHD layout).

Per step (``build_metadata``, host work, once for all layers):

* the page table goes to CSR form: ``kv_indptr[B+1]``, ``kv_indices`` (the first
  ``ceil(kv_len / block_size)`` blocks of each request), ``kv_last_page_len[B]`` in
  ``1..block_size``; int32 host tensors, copied to the device by ``plan()``;
* a batch whose requests all have ``q_len == 1`` is planned on a
  ``BatchDecodeWithPagedKVCacheWrapper``; any other batch (prefill chunks, (1 + k)-token
  verifies, decodes, mixed) on a ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``,
  which FlashInfer aligns bottom-right (query row i of a request sees keys
  ``0 .. kv_len - q_len + i``), exactly what chunks and verifies need;
* exactly one ``plan()``; every layer's ``attend`` then calls ``run()`` on the planned wrapper.

``write_kv`` is the slot-mapping write of ``kernels.kv_write`` (Triton on CUDA when triton is
installed, else torch index_put); padding rows past ``num_tokens`` are not written.

State: the wrappers hold the plan, so metadata is valid until the next ``build_metadata`` on
the same backend (checked: each metadata records the plan generation). Use one backend
instance per model (target and drafter each their own).

Batch invariance (docs/DESIGN.md, "Lossless in floating point"): a decode batch runs the decode
kernel, a verify the prefill kernel, so a position's arithmetic may differ between plain and
speculative decoding. ``use_decode_kernel=False`` sends every batch through the prefill wrapper
and ``deterministic=True`` disables split-kv; whether either makes greedy outputs identical is
a GPU measurement still owed, not a promise.

CUDA graphs: :meth:`FlashInferBackend.graph_state` builds a :class:`GraphAttentionState` for one
(batch size, query length) bucket, with ``use_cuda_graph=True`` wrappers over fixed buffers;
``plan()`` stays outside the graph and refills those buffers before each replay
(see ``engine/cuda_graphs.py``).

Import-safe without flashinfer or CUDA: flashinfer is imported in ``__init__`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenbudget.kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    check_metadata_inputs,
)
from tokenbudget.kernels.kv_write import write_kv as _write_kv

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(slots=True)
class PageTable:
    """CSR page table (host int32 tensors) as FlashInfer's ``plan()`` takes it."""

    qo_indptr: torch.Tensor        # [B + 1]
    kv_indptr: torch.Tensor        # [B + 1]
    kv_indices: torch.Tensor       # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [B], 1..block_size


def build_page_table(qo_indptr: list[int], kv_lens: list[int], block_tables: list[list[int]],
                     block_size: int) -> PageTable:
    """Host-side CSR build, one pass over the B requests."""
    kv_indptr, indices, last = [0], [], []
    for kv_len, table in zip(kv_lens, block_tables):
        n = -(-kv_len // block_size)
        indices.extend(table[:n])
        kv_indptr.append(kv_indptr[-1] + n)
        last.append(kv_len - (n - 1) * block_size)
    i32 = torch.int32
    return PageTable(torch.tensor(qo_indptr, dtype=i32), torch.tensor(kv_indptr, dtype=i32),
                     torch.tensor(indices, dtype=i32), torch.tensor(last, dtype=i32))


@dataclass(slots=True)
class FlashInferData:
    """``AttentionMetadata.backend_data`` of this backend."""

    wrapper: Any                # the planned BatchPrefill/BatchDecode wrapper
    is_decode: bool
    generation: int             # plan generation of ``owner`` at build time
    owner: Any                  # the FlashInferBackend or GraphAttentionState that planned
    row_valid: torch.Tensor | None = None  # graph mode: [T] bool, False on padding rows


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cuda", *,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, fa_backend: str = "fa2",
                 use_decode_kernel: bool = True, use_tensor_cores: bool = True,
                 deterministic: bool = False) -> None:
        super().__init__(spec, device)
        if self.device.type != "cuda":
            raise ValueError(f"FlashInferBackend needs a CUDA device, got {self.device}")
        if spec.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FlashInferBackend needs a float16/bfloat16 KV cache, got {spec.dtype}")
        import flashinfer  # fails loudly here, not at import of this module

        self._fi = flashinfer
        self.fa_backend = fa_backend
        self.use_decode_kernel = use_decode_kernel
        self.use_tensor_cores = use_tensor_cores
        self.deterministic = deterministic
        # One float workspace shared by every wrapper (eager and graph): they never run
        # concurrently (one stream, one step at a time). Zeroed: decode requires it.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=fa_backend)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=use_tensor_cores, backend=fa_backend)
        self.generation = 0

    # ---- planning -------------------------------------------------------------------------
    def plan_kwargs(self) -> dict:
        s = self.spec
        return dict(sm_scale=s.softmax_scale, q_data_type=s.dtype, kv_data_type=s.dtype,
                    disable_split_kv=self.deterministic)

    def plan(self, wrapper, is_decode: bool, pt: PageTable) -> None:
        """One ``plan()`` on ``wrapper`` (host work; never inside a CUDA graph capture)."""
        s = self.spec
        if is_decode:
            wrapper.plan(pt.kv_indptr, pt.kv_indices, pt.kv_last_page_len, s.num_heads,
                         s.num_kv_heads, s.head_dim, s.block_size, **self.plan_kwargs())
        else:
            wrapper.plan(pt.qo_indptr, pt.kv_indptr, pt.kv_indices, pt.kv_last_page_len,
                         s.num_heads, s.num_kv_heads, s.head_dim, s.block_size, causal=True,
                         **self.plan_kwargs())

    def build_metadata(self, qo_indptr: list[int], kv_lens: list[int],
                       block_tables: list[list[int]], slot_mapping: torch.Tensor) -> AttentionMetadata:
        check_metadata_inputs(qo_indptr, kv_lens, block_tables, self.spec.block_size)
        num_tokens = qo_indptr[-1]
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, expected {num_tokens}")
        is_decode = self.use_decode_kernel and num_tokens == len(kv_lens)
        wrapper = self._decode if is_decode else self._prefill
        self.plan(wrapper, is_decode,
                  build_page_table(qo_indptr, kv_lens, block_tables, self.spec.block_size))
        self.generation += 1
        slots = slot_mapping.to(device=self.device, dtype=torch.long, non_blocking=True)
        data = FlashInferData(wrapper, is_decode, self.generation, self)
        return AttentionMetadata(list(qo_indptr), list(kv_lens), block_tables, slots,
                                 num_tokens, data, self)

    # ---- per layer ------------------------------------------------------------------------
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        n = metadata.num_tokens
        if k.dtype != kv_cache.dtype:
            k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        _write_kv(k[:n], v[:n], kv_cache, metadata.slot_mapping[:n])

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        d: FlashInferData = metadata.backend_data
        if d.generation != d.owner.generation:
            raise RuntimeError("stale attention metadata: the wrapper was re-planned since "
                               "this metadata was built (one backend per model, one step at a time)")
        n = metadata.num_tokens
        out = q.new_zeros(q.shape) if q.shape[0] != n else torch.empty_like(q)
        d.wrapper.run(q[:n].contiguous(), kv_cache, out=out[:n])
        if d.row_valid is not None:  # graph mode: rows of padding requests hold garbage
            out = torch.where(d.row_valid[:, None, None], out, torch.zeros((), dtype=out.dtype,
                                                                           device=out.device))
        return out

    # ---- CUDA graphs ----------------------------------------------------------------------
    def graph_state(self, batch_size: int, q_len: int, max_pages: int) -> GraphAttentionState:
        """A fixed-shape attention state for graph capture: ``batch_size`` requests of
        exactly ``q_len`` query rows each, at most ``max_pages`` pages in all."""
        return GraphAttentionState(self, batch_size, q_len, max_pages)


class GraphAttentionState:
    """FlashInfer wrappers in ``use_cuda_graph=True`` mode over fixed device buffers.

    Shape of the bucket: ``B = batch_size`` requests of ``L = q_len`` rows (``T = B * L``).
    :meth:`prepare` takes a real batch of ``B' <= B`` such requests, pads it with dummy
    requests (``kv_len = L``, pages = block 0, read but never written, outputs discarded),
    plans (host side, refilling the fixed buffers in place) and returns metadata whose
    ``slot_mapping`` and ``row_valid`` are fixed buffers too, so a captured graph sees the
    new step through them. ``metadata.num_tokens == T`` always; padding slots are -1.
    """

    def __init__(self, backend: FlashInferBackend, batch_size: int, q_len: int, max_pages: int):
        if batch_size < 1 or q_len < 1 or max_pages < batch_size:
            raise ValueError(f"bad graph bucket: batch_size={batch_size} q_len={q_len} "
                             f"max_pages={max_pages}")
        fi, dev = backend._fi, backend.device
        self.backend, self.batch_size, self.q_len = backend, batch_size, q_len
        self.num_tokens = batch_size * q_len
        i32 = dict(dtype=torch.int32, device=dev)
        self.qo_indptr = torch.arange(0, self.num_tokens + 1, q_len, **i32)
        self.kv_indptr = torch.zeros(batch_size + 1, **i32)
        self.kv_indices = torch.zeros(max_pages, **i32)
        self.kv_last_page_len = torch.ones(batch_size, **i32)
        self.slot_mapping = torch.full((self.num_tokens,), -1, dtype=torch.long, device=dev)
        self.row_valid = torch.zeros(self.num_tokens, dtype=torch.bool, device=dev)
        self.is_decode = q_len == 1 and backend.use_decode_kernel
        if self.is_decode:
            self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                backend.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=backend.use_tensor_cores, backend=backend.fa_backend,
                paged_kv_indptr_buffer=self.kv_indptr, paged_kv_indices_buffer=self.kv_indices,
                paged_kv_last_page_len_buffer=self.kv_last_page_len)
        else:
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                backend.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr,
                paged_kv_indptr_buf=self.kv_indptr, paged_kv_indices_buf=self.kv_indices,
                paged_kv_last_page_len_buf=self.kv_last_page_len, backend=backend.fa_backend)
        self.generation = 0

    def fits(self, qo_indptr: list[int]) -> bool:
        """Whether a batch with these query offsets can run in this bucket."""
        b = len(qo_indptr) - 1
        return 1 <= b <= self.batch_size and all(
            qo_indptr[i + 1] - qo_indptr[i] == self.q_len for i in range(b))

    def prepare(self, qo_indptr: list[int], kv_lens: list[int], block_tables: list[list[int]],
                slot_mapping: torch.Tensor) -> AttentionMetadata:
        be = self.backend
        bs = be.spec.block_size
        check_metadata_inputs(qo_indptr, kv_lens, block_tables, bs)
        if not self.fits(qo_indptr):
            raise ValueError(f"batch does not fit graph bucket B={self.batch_size} L={self.q_len}")
        real, n = len(kv_lens), qo_indptr[-1]
        pad = self.batch_size - real
        dummy_pages = [0] * -(-self.q_len // bs)
        pt = build_page_table(
            list(range(0, self.num_tokens + 1, self.q_len)), list(kv_lens) + [self.q_len] * pad,
            list(block_tables) + [dummy_pages] * pad, bs)
        be.plan(self.wrapper, self.is_decode, pt)
        self.generation += 1
        self.slot_mapping[n:].fill_(-1)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        torch.lt(torch.arange(self.num_tokens, device=self.row_valid.device), n, out=self.row_valid)
        data = FlashInferData(self.wrapper, self.is_decode, self.generation, self, self.row_valid)
        return AttentionMetadata(list(qo_indptr), list(kv_lens), block_tables, self.slot_mapping,
                                 self.num_tokens, data, be)


__all__ = ["FlashInferBackend", "FlashInferData", "GraphAttentionState", "PageTable",
           "build_page_table"]
