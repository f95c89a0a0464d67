"""FlashInfer attention backend (CUDA), written against flashinfer-python 0.6.18.post1.

Implements :class:`kernels.attention.base.AttentionBackend` over the same per-layer cache tensor
``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (FlashInfer's combined NHD layout).

Per step (``build_metadata``, host work, once for all layers) the page table goes to CSR form
(``kv_indptr``, ``kv_indices``, ``kv_last_page_len``; int32 host tensors) and the requests are
split into GROUPS by query length, each planned on its own wrapper:

* requests with ``q_len = L <= UNIFORM_MAX_Q_LEN`` (decodes, L = 1; (1 + k)-token verifies) go
  through a tensor-core ``BatchDecodeWithPagedKVCacheWrapper`` planned with ``q_len_per_req=L``
  and ``disable_split_kv=True``. Tensor-core decode runs FlashInfer's *prefill* kernel with a CTA
  tile chosen from the packed rows ``L * G`` (G = query heads per kv head): 16 rows up to 16,
  64 up to 64, else 128. Without a KV split a row's arithmetic depends only on its own request
  and its group's tile: not on its neighbours in a mixed batch, not on the batch size. So a
  decode and a verify of the same position can differ (a GQA-4 decode packs 4 rows, tile 16; a
  5-row verify 20, tile 64), and a CUDA-graph replay of a uniform bucket is planned exactly like
  eager while a padded one (fewer drafts than the bucket's k) runs the bucket's tile;
* a uniform request of fewer rows than the *tile floor* is planned with the floor, padding rows
  after its real ones (the planned context grows by the padding, which keeps every real row's
  bottom-right causal limit; pages past the table point at block 0 and are read by padding rows
  only). The floor is the smallest L whose tile equals the tile of the longest verify the engine
  runs (``align_tiles(1 + max_spec_tokens)``, called by the wiring): then a decode and every
  verify of a request run the same CTA tile, and with the same tile a row's bits do not depend
  on L (measured on an H200: benches/RESULTS.md, "First GPU run"). Without it a GQA-4 decode
  (4 packed rows, tile 16) and a 5-row verify (20, tile 64) differ in the last bits, and greedy
  speculation drifts from plain decoding at k >= 4. Deterministic mode aligns to the longest
  uniform group (``DETERMINISTIC_Q_LEN`` = 16) whatever the engine's k. Cost: a decode attends
  with the floor's rows (a GQA-4 layout with k >= 4: 5 rows instead of 1; attention only, the
  GEMMs see the real rows);
* the rest (prefill chunks) go through one ``BatchPrefillWithPagedKVCacheWrapper``
  (``causal=True``, bottom-right aligned), split-KV as FlashInfer chooses unless
  ``deterministic=True``.

Cost of the no-split rule: a small batch with a long context gets fewer CTAs (no split-KV
parallelism); ``benches/gpu_check.py`` measures it (the verify-cost curve).

Planning is lazy: ``build_metadata`` records the groups, the first layer's ``attend`` plans
them (exactly one ``plan()`` per group per step). A CUDA-graph replay builds its own plan
(:class:`GraphAttentionState`), so a replayed step never plans the eager wrappers.

``write_kv`` is the slot-mapping write of ``kernels.kv_write`` (Triton on CUDA when triton is
installed, else torch index_put); rows past ``num_tokens`` and slots -1 are not written.

State: the wrappers hold the plan, so metadata is valid until the next ``build_metadata`` on
the same backend (checked through a generation counter). One backend instance per model.
``plan()`` fills a wrapper's page-locked int buffer and copies it to the device asynchronously;
the next step's ``plan()`` of the same wrapper must not rewrite it before that copy ran. The
``torch.cuda.synchronize()`` that ends every CUDA step in ``ModelRunner.execute`` guarantees it
(kept: the sampled tokens' host copy synchronises there anyway, so an event per wrapper would
save nothing).

Import-safe without flashinfer or CUDA: flashinfer is imported in ``__init__`` only, and a
stand-in module with the same wrapper signatures may be passed instead (``flashinfer=``; the
CPU tests do, see ``tests/flashinfer_standin.py``).
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
from tokenbudget.kernels.attention.flashinfer_plan import (
    DETERMINISTIC_Q_LEN,
    UNIFORM_MAX_Q_LEN,
    PageTable,
    build_page_table,
    eager_workspace_bytes,
    flashinfer_refusal,
    tile_floor,
)
from tokenbudget.kernels.kv_write import write_kv as _write_kv

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
@dataclass(slots=True)
class _Group:
    """Requests planned together on one wrapper."""

    wrapper: Any
    q_len: int                    # planned L of a uniform group; 0 for the prefill group
    page_table: PageTable
    rows: torch.Tensor | None     # flat query rows of the group (None: all rows, in order)
    dest: torch.Tensor | None = None  # padded group: the planned rows of ``rows`` (B * L in all)


@dataclass(slots=True)
class FlashInferData:
    """``AttentionMetadata.backend_data`` of this backend."""

    groups: list[_Group]
    generation: int                      # plan generation of ``owner`` at build time
    owner: Any                           # the FlashInferBackend or GraphAttentionState
    planned: bool = False
    row_pad: torch.Tensor | None = None  # graph mode: [T] bool, True on padding rows


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    # attend() calls in this process, all instances: benches/gpu_check.py's proof that the
    # FlashInfer kernels (or, in CPU tests, the stand-in) really ran in a section
    attend_calls = 0

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cuda", *,
                 workspace_bytes: int | None = None, fa_backend: str = "fa2",
                 deterministic: bool = False, flashinfer: Any = None,
                 num_sms: int | None = None) -> None:
        super().__init__(spec, device)
        if flashinfer is None:  # the real package; a stand-in module may be passed (tests, CPU)
            why = flashinfer_refusal(spec, self.device)
            if why:
                raise ValueError(f"FlashInferBackend: {why}")
            import flashinfer  # fails loudly here, not at import of this module
        self._fi = flashinfer
        self.fa_backend = fa_backend
        self.deterministic = deterministic
        self.q_len_floor = 1
        self.align_tiles(DETERMINISTIC_Q_LEN if deterministic else 1)
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if workspace_bytes is None:  # 128 MiB (FlashInfer's advice) or what the shape needs
            workspace_bytes = max(DEFAULT_WORKSPACE_BYTES, eager_workspace_bytes(spec, num_sms))
        # One float workspace shared by every wrapper (eager and graph): they never run
        # concurrently (one stream, one step at a time). Zeroed: decode requires it.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=fa_backend)
        self._uniform: dict[int, Any] = {}   # q_len -> tensor-core decode wrapper
        self.generation = 0

    # ---- planning -------------------------------------------------------------------------
    def uniform_wrapper(self, q_len: int) -> Any:
        if q_len not in self._uniform:
            self._uniform[q_len] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=True, backend=self.fa_backend)
        return self._uniform[q_len]

    def plan(self, wrapper, q_len: int, pt: PageTable) -> None:
        """One ``plan()`` on ``wrapper`` (host work; never inside a CUDA graph capture).
        ``q_len`` > 0: a uniform group through tensor-core decode, never split; 0: prefill."""
        s = self.spec
        kw = {"sm_scale": s.softmax_scale, "q_data_type": s.dtype, "kv_data_type": s.dtype}
        if q_len:
            wrapper.plan(pt.kv_indptr, pt.kv_indices, pt.kv_last_page_len, s.num_heads,
                         s.num_kv_heads, s.head_dim, s.block_size, q_len_per_req=q_len,
                         disable_split_kv=True, **kw)
        else:
            wrapper.plan(pt.qo_indptr, pt.kv_indptr, pt.kv_indices, pt.kv_last_page_len,
                         s.num_heads, s.num_kv_heads, s.head_dim, s.block_size, causal=True,
                         disable_split_kv=self.deterministic, **kw)

    def build_metadata(self, qo_indptr: list[int], kv_lens: list[int],
                       block_tables: list[list[int]], slot_mapping: torch.Tensor) -> AttentionMetadata:
        check_metadata_inputs(qo_indptr, kv_lens, block_tables, self.spec.block_size)
        num_tokens = qo_indptr[-1]
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, expected {num_tokens}")
        by_len: dict[int, list[int]] = {}
        for b in range(len(kv_lens)):
            q_len = qo_indptr[b + 1] - qo_indptr[b]
            key = 0 if q_len > UNIFORM_MAX_Q_LEN else self.planned_q_len(q_len)
            by_len.setdefault(key, []).append(b)
        groups = [self._group(key, reqs, qo_indptr, kv_lens, block_tables, len(by_len) == 1)
                  for key, reqs in sorted(by_len.items())]
        self.generation += 1
        slots = slot_mapping.to(device=self.device, dtype=torch.long, non_blocking=True)
        data = FlashInferData(groups, self.generation, self)
        return AttentionMetadata(list(qo_indptr), list(kv_lens), block_tables, slots,
                                 num_tokens, data, self)

    def align_tiles(self, max_q_len: int) -> None:
        """Plan every uniform request with at least the tile floor of ``max_q_len`` rows (the
        engine's longest verify, ``1 + max_spec_tokens``), so decodes and verifies share a tile
        (module docstring). Deterministic mode keeps the floor of ``DETERMINISTIC_Q_LEN``."""
        if self.deterministic:
            max_q_len = DETERMINISTIC_Q_LEN
        if not 1 <= max_q_len:
            raise ValueError(f"max_q_len={max_q_len}: expected >= 1")
        group = self.spec.num_heads // self.spec.num_kv_heads
        self.q_len_floor = tile_floor(min(max_q_len, UNIFORM_MAX_Q_LEN), group, self.spec.head_dim)

    def planned_q_len(self, q_len: int) -> int:
        """The L a uniform request of ``q_len`` rows is planned with: at least the tile floor."""
        return max(q_len, self.q_len_floor)

    def _group(self, q_len: int, reqs: list[int], qo_indptr: list[int], kv_lens: list[int],
               block_tables: list[list[int]], whole: bool) -> _Group:
        sub_qo, rows, dest, kv, tables = [0], [], [], [], []
        bs = self.spec.block_size
        padded = False
        for i, b in enumerate(reqs):
            n = qo_indptr[b + 1] - qo_indptr[b]
            rows.extend(range(qo_indptr[b], qo_indptr[b + 1]))
            sub_qo.append(len(rows))
            pad = q_len - n if q_len else 0  # padding rows after the real ones (as in a graph)
            padded |= pad > 0
            dest.extend(range(i * q_len, i * q_len + n) if q_len else ())
            kv.append(kv_lens[b] + pad)
            need = -(-kv[-1] // bs)
            tables.append(list(block_tables[b][:need]) + [0] * (need - len(block_tables[b])))
        if padded:
            sub_qo = list(range(0, len(reqs) * q_len + 1, q_len))
        pt = build_page_table(sub_qo, kv, tables, bs)
        wrapper = self.uniform_wrapper(q_len) if q_len else self._prefill
        def to_dev(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long).to(self.device, non_blocking=True)
        row_t = None if whole and not padded else to_dev(rows)
        return _Group(wrapper, q_len, pt, row_t, to_dev(dest) if padded else None)

    # ---- per layer ------------------------------------------------------------------------
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        n = metadata.num_tokens
        if k.dtype != kv_cache.dtype:
            k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        _write_kv(k[:n], v[:n], kv_cache, metadata.slot_mapping[:n])

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if window or sinks is not None:
            raise NotImplementedError("sliding-window attention and sinks are not planned on FlashInfer yet")
        d: FlashInferData = metadata.backend_data
        FlashInferBackend.attend_calls += 1
        if d.generation != d.owner.generation:
            raise RuntimeError("stale attention metadata: the wrapper was re-planned since "
                               "this metadata was built (one backend per model, one step at a time)")
        if not d.planned:  # first layer of the step: one plan per group
            for g in d.groups:
                self.plan(g.wrapper, g.q_len, g.page_table)
            d.planned = True
        n = metadata.num_tokens
        out = torch.empty_like(q)
        if q.shape[0] > n:  # the model's row padding (pad_rows): zeros, no per-layer zero tensor
            out[n:].zero_()
        for g in d.groups:
            if g.dest is None and g.rows is None:
                g.wrapper.run(q[:n].contiguous(), kv_cache, out=out[:n])
                continue
            src = q[:n] if g.rows is None else q.index_select(0, g.rows)
            if g.dest is not None:  # rows padded to the group's planned L (the tile floor)
                qp = q.new_zeros(g.page_table.kv_last_page_len.shape[0] * g.q_len, *q.shape[1:])
                qp.index_copy_(0, g.dest, src)
                res = g.wrapper.run(qp, kv_cache).index_select(0, g.dest)
            else:
                res = g.wrapper.run(src, kv_cache)
            if g.rows is None:
                out[:n].copy_(res)
            else:
                out.index_copy_(0, g.rows, res)
        if d.row_pad is not None:  # graph mode: rows of padding requests/drafts hold garbage
            out[:n].masked_fill_(d.row_pad[:, None, None], 0)
        return out

    # ---- CUDA graphs ----------------------------------------------------------------------
    def graph_state(self, batch_size: int, q_len: int, max_pages: int) -> GraphAttentionState:
        """A fixed-shape attention state for graph capture: ``batch_size`` requests of at
        most ``q_len`` query rows each, at most ``max_pages`` pages in all."""
        return GraphAttentionState(self, batch_size, q_len, max_pages)


def zero_int_workspaces(wrapper: Any) -> None:
    """Zero a ``use_cuda_graph=True`` wrapper's int workspaces (device and page-locked host).

    In graph mode FlashInfer launches a padded grid, ``max(2 * #SM / num_kv_heads, tiles)``
    CTAs, but ``plan()`` writes scheduler entries (request, q-tile and kv-tile indices) for the
    real tiles only; the padding CTAs read what the buffers held before. Both are ``torch.empty``
    and torch's pinned-memory cache recycles earlier wrappers' buffers, so those entries were
    wild request indices: illegal memory access or silent corruption (flashinfer issue #4002).
    Zeroed once here, they stay zero (a bucket's real tile count never changes, so every plan
    writes the same entries): a padding CTA recomputes request 0's first tile and writes the same
    values again. The buffer names are 0.6.18.post1's (``flashinfer/decode.py``)."""
    for name in ("_int_workspace_buffer", "_pin_memory_int_workspace_buffer"):
        buf = getattr(wrapper, name, None)
        if not isinstance(buf, torch.Tensor):
            raise RuntimeError(f"flashinfer wrapper has no {name} (written against 0.6.18.post1): "
                               "cannot zero the graph-mode scheduler padding")
        buf.zero_()


class GraphAttentionState:
    """A tensor-core decode wrapper in ``use_cuda_graph=True`` mode over fixed device buffers,
    planned like the eager uniform groups (``q_len_per_req`` = the backend's planned length of
    ``L``, no KV split): every step in the bucket runs the tile of the eager plan of the same
    requests, padded or not, since both are at least the tile floor (with tiles aligned to the
    bucket's longest verify). The model's rows stay ``B * L``: only attention sees the planned
    length's padding (a static row map, like the eager padded groups), so a decode bucket's GEMMs
    run ``B`` rows, not ``B * 16``.

    Bucket: ``B = batch_size`` requests of ``L = q_len`` rows (``T = B * L``); request ``b``
    owns rows ``b*L .. b*L+L-1``. :meth:`prepare` takes a real batch of ``B' <= B`` requests
    with ``1 <= q_len_b <= L`` rows each (draft counts that vary, e.g. n-gram drafts): request
    ``b``'s real rows are the first ``q_len_b`` of its slot and its planned context is
    ``kv_len_b + (L - q_len_b)`` (bottom-right causal alignment keeps every real row's limit;
    missing pages point at block 0, read only by padding rows); requests ``B'..B-1`` are dummies
    (``kv_len = L`` on block 0). Padding rows write nothing (slot -1) and are zeroed.
    ``metadata.num_tokens == T``; :attr:`dest` maps the real rows to their bucket rows.
    """

    def __init__(self, backend: FlashInferBackend, batch_size: int, q_len: int, max_pages: int):
        if batch_size < 1 or q_len < 1 or q_len > UNIFORM_MAX_Q_LEN or max_pages < batch_size:
            raise ValueError(f"bad graph bucket: batch_size={batch_size} q_len={q_len} "
                             f"max_pages={max_pages}")
        fi, dev = backend._fi, backend.device
        self.backend, self.batch_size, self.q_len = backend, batch_size, q_len
        self.plan_len = backend.planned_q_len(q_len)  # >= q_len: the tile floor
        self.num_tokens = batch_size * q_len
        # bucket row b*L + j -> planned row b*P + j (None when P == L: no padding in attention)
        self.attn_rows = None if self.plan_len == q_len else torch.tensor(
            [b * self.plan_len + j for b in range(batch_size) for j in range(q_len)], device=dev)
        i32 = {"dtype": torch.int32, "device": dev}
        self.kv_indptr = torch.zeros(batch_size + 1, **i32)
        self.kv_indices = torch.zeros(max_pages + batch_size, **i32)
        self.kv_last_page_len = torch.ones(batch_size, **i32)
        self.slot_mapping = torch.full((self.num_tokens,), -1, dtype=torch.long, device=dev)
        self.row_pad = torch.ones(self.num_tokens, dtype=torch.bool, device=dev)
        self.dest = torch.arange(self.num_tokens, device=dev)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            backend.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=self.kv_indptr, paged_kv_indices_buffer=self.kv_indices,
            paged_kv_last_page_len_buffer=self.kv_last_page_len, backend=backend.fa_backend)
        zero_int_workspaces(self.wrapper)
        self.generation = 0
        self._data = FlashInferData([], 0, self, planned=True, row_pad=self.row_pad)

    def fits(self, qo_indptr: list[int]) -> bool:
        """Whether a batch with these query offsets can run in this bucket."""
        b = len(qo_indptr) - 1
        return 1 <= b <= self.batch_size and all(
            1 <= qo_indptr[i + 1] - qo_indptr[i] <= self.q_len for i in range(b))

    def prepare(self, qo_indptr: list[int], kv_lens: list[int], block_tables: list[list[int]],
                slot_mapping: torch.Tensor) -> AttentionMetadata:
        be, L, P = self.backend, self.q_len, self.plan_len
        bs = be.spec.block_size
        check_metadata_inputs(qo_indptr, kv_lens, block_tables, bs)
        if not self.fits(qo_indptr):
            raise ValueError(f"batch does not fit graph bucket B={self.batch_size} L={L}")
        real = len(kv_lens)
        kv, tables, dest = [], [], []
        for b in range(real):
            q_len = qo_indptr[b + 1] - qo_indptr[b]
            kv.append(kv_lens[b] + P - q_len)  # padding to P rows: same causal limits
            need = -(-kv[-1] // bs)
            tables.append(list(block_tables[b][:need]) + [0] * (need - len(block_tables[b])))
            dest.extend(range(b * L, b * L + q_len))
        pad = self.batch_size - real
        pt = build_page_table(list(range(0, self.batch_size * P + 1, P)), kv + [P] * pad,
                              tables + [[0] * -(-P // bs)] * pad, bs)
        be.plan(self.wrapper, P, pt)
        self.generation += 1
        dest_t = torch.tensor(dest, dtype=torch.long).to(self.dest.device, non_blocking=True)
        self.dest = dest_t
        self.slot_mapping.fill_(-1)
        self.slot_mapping.index_copy_(0, dest_t, slot_mapping.to(torch.long))
        self.row_pad.fill_(True)
        self.row_pad.index_fill_(0, dest_t, False)
        # One data object for every prepare: the metadata a graph captured stays current.
        self._data.groups = [_Group(self.wrapper, P, pt, None, self.attn_rows)]
        self._data.generation = self.generation
        return AttentionMetadata(list(range(0, self.num_tokens + 1, L)), kv + [P] * pad,
                                 tables, self.slot_mapping, self.num_tokens, self._data, be)


__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "FlashInferBackend",
    "FlashInferData",
    "GraphAttentionState",
    "zero_int_workspaces",
]
