"""CUDA-graph runner for decode and verify batches (FlashInfer backend).

:class:`CUDAGraphRunner` wraps a model with the ``forward(input_ids, positions, attn_metadata,
kv_caches)`` signature and is itself a drop-in model (same call, ``compute_logits`` passed
through), so ``ModelRunner(model=CUDAGraphRunner(...), ...)`` needs no other change.

Buckets: every ``(B, L)`` with ``B`` in ``batch_sizes`` and ``L = 1 + k`` for ``k`` in
``draft_lens``: ``B`` requests of exactly ``L`` query rows each (``L == 1``: plain decode;
``L > 1``: a uniform (1 + k)-token verify). All graphs are captured at start-up
(:meth:`capture`), largest first, sharing one memory pool. A step whose requests all have the
same ``q_len == L`` of some bucket and whose request count fits a captured ``B`` runs in the
smallest such graph; anything else (prefill chunks, mixed lengths, too many requests) runs
eagerly, unchanged.

Replay: FlashInfer's ``plan()`` is host work that cannot be captured. Each bucket owns a
:class:`~kernels.attention.flashinfer_backend.GraphAttentionState` whose wrappers were built with
``use_cuda_graph=True`` over fixed buffers; before a replay, ``prepare`` pads the batch with dummy
requests, re-plans (refilling the buffers in place) and refreshes the fixed ``slot_mapping``
(-1 on padding rows: no K/V write) and ``row_valid`` buffers; static ``input_ids`` and
``positions`` get the new tokens (zeros on padding rows). Outputs are the rows of the static
hidden-state buffer for the real tokens: valid until the next replay of the same bucket.

Requirements: CUDA, a :class:`FlashInferBackend`, and triton (the K/V write inside a graph must
be sync-free; the torch fallback uses boolean indexing, which syncs). Tests:
``tests/test_cuda_graphs.py`` (replay == eager; skipped without a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbudget.kernels.attention.base import AttentionMetadata
from tokenbudget.kernels.triton_utils import HAS_TRITON


@dataclass(slots=True)
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    attn: object               # GraphAttentionState
    input_ids: torch.Tensor    # [T] int64, static
    positions: torch.Tensor    # [T] int64, static
    hidden: torch.Tensor       # [T, hidden] output of the captured forward


class CUDAGraphRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], backend, *,
                 batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                 draft_lens: tuple[int, ...] = (0,), max_pages_per_req: int,
                 num_warmup: int = 2) -> None:
        if not torch.cuda.is_available():
            raise ValueError("CUDAGraphRunner needs CUDA")
        if not HAS_TRITON:
            raise ValueError("CUDAGraphRunner needs triton (sync-free K/V write inside graphs)")
        if not hasattr(backend, "graph_state"):
            raise ValueError(f"backend {getattr(backend, 'name', backend)!r} has no graph_state "
                             "(use the FlashInfer backend)")
        if not batch_sizes or min(batch_sizes) < 1 or not draft_lens or min(draft_lens) < 0:
            raise ValueError(f"bad buckets: batch_sizes={batch_sizes} draft_lens={draft_lens}")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.q_lens = tuple(sorted({1 + k for k in draft_lens}))
        self.max_pages_per_req = max_pages_per_req
        self.num_warmup = num_warmup
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = None

    # ---- drop-in model interface -----------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        if kv_caches is not self.kv_caches:
            raise ValueError("CUDAGraphRunner was captured over other kv_caches")
        cap = self._bucket_for(attn_metadata.qo_indptr)
        if cap is None:
            return self.model(input_ids, positions, attn_metadata, kv_caches)
        return self._replay(cap, input_ids, positions, attn_metadata)

    # ---- capture --------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse the shared pool)."""
        self._pool = torch.cuda.graph_pool_handle()
        for q_len in reversed(self.q_lens):
            for bsz in reversed(self.batch_sizes):
                self.graphs[(bsz, q_len)] = self._capture_one(bsz, q_len)
        torch.cuda.synchronize()

    def _capture_one(self, bsz: int, q_len: int) -> _Captured:
        bs = self.backend.spec.block_size
        attn = self.backend.graph_state(bsz, q_len, bsz * self.max_pages_per_req)
        n = bsz * q_len
        dev = self.backend.device
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        pos = torch.zeros(n, dtype=torch.long, device=dev)
        # A dummy batch shaped like the bucket; slots -1: nothing is written to the caches.
        md = attn.prepare(list(range(0, n + 1, q_len)), [q_len] * bsz,
                          [[0] * -(-q_len // bs)] * bsz,
                          torch.full((n,), -1, dtype=torch.long, device=dev))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: JIT compiles, allocator settles
            for _ in range(self.num_warmup):
                self.model(ids, pos, md, self.kv_caches)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self.model(ids, pos, md, self.kv_caches)
        return _Captured(graph, attn, ids, pos, hidden)

    # ---- replay ---------------------------------------------------------------------------
    def _bucket_for(self, qo_indptr: list[int]) -> _Captured | None:
        b = len(qo_indptr) - 1
        if b < 1 or not self.graphs:
            return None
        q_len = qo_indptr[1] - qo_indptr[0]
        if qo_indptr[-1] != b * q_len or any(
                qo_indptr[i + 1] - qo_indptr[i] != q_len for i in range(b)):
            return None
        for bsz in self.batch_sizes:
            if bsz >= b and (bsz, q_len) in self.graphs:
                return self.graphs[(bsz, q_len)]
        return None

    def _replay(self, cap: _Captured, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        n = md.num_tokens
        cap.attn.prepare(md.qo_indptr, md.kv_lens, md.block_tables, md.slot_mapping[:n])
        cap.input_ids[n:].zero_()
        cap.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        cap.positions[n:].zero_()
        cap.positions[:n].copy_(positions[:n], non_blocking=True)
        cap.graph.replay()
        return cap.hidden[:n]


__all__ = ["CUDAGraphRunner"]
