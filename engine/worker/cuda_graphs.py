"""CUDA-graph runner for decode and verify batches (FlashInfer backend).

:class:`CUDAGraphRunner` wraps a model with the ``forward(input_ids, positions, attn_metadata,
kv_caches)`` signature and is itself a drop-in model (same call, ``compute_logits`` passed
through), so ``ModelRunner(model=CUDAGraphRunner(...), ...)`` needs no other change.

Buckets: every ``(B, L)`` with ``B`` in ``batch_sizes`` and ``L = 1 + k`` for ``k`` in
``draft_lens`` up to ``UNIFORM_MAX_Q_LEN`` (a longer verify runs eagerly). A bucket's model runs
``B * L`` rows; its attention plans the backend's padded length (``planned_q_len``, the tile
floor), as the eager groups do, so replay and eager run the same tile. All
graphs are captured at start-up (:meth:`capture`), largest first, sharing one memory pool. A step
of ``b`` requests with ``1 <= q_len <= L`` rows each runs in the graph of the smallest captured
``L >= max q_len`` and the smallest ``B >= b``: draft counts that vary from request to request
(n-gram, suffix drafts) are padded to the bucket, not sent to the eager path. Anything else
(prefill chunks longer than every L, too many requests) runs eagerly, unchanged.

Replay: FlashInfer's ``plan()`` is host work that cannot be captured. Each bucket owns a
:class:`~kernels.attention.flashinfer_backend.GraphAttentionState` whose wrapper was built with
``use_cuda_graph=True`` over fixed buffers; before a replay, ``prepare`` pads the batch (padding
rows and dummy requests), plans ONCE (refilling the buffers in place; the eager wrappers are not
planned: their planning is lazy) and refreshes the fixed ``slot_mapping`` (-1 on padding rows:
no K/V write) and ``row_pad`` buffers; the static ``input_ids`` and ``positions`` get the real
tokens at their bucket rows (zeros elsewhere). The output is the real rows of the static hidden
state, gathered in the step's order; with EAGLE-3 taps set (``set_aux_layers``: the graphs are
captured with them) a call asked for them (``aux_layers``) returns ``(hidden, aux)``, the taps
gathered the same way.

The graph API is a small driver (:class:`CudaGraphDriver`: warm up, capture into the shared
pool, replay). Tests pass a driver that replays by re-running the captured function over the
same static buffers, so the bucketing, padding and capture bookkeeping run on CPU.

Requirements with the real driver: CUDA, a backend with ``graph_state`` (FlashInfer), and
triton (the K/V write inside a graph must be sync-free; the torch fallback syncs).
Tests: ``tests/test_cuda_graphs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbudget.kernels.attention.base import AttentionMetadata
from tokenbudget.kernels.attention.flashinfer_plan import UNIFORM_MAX_Q_LEN
from tokenbudget.kernels.triton_utils import HAS_TRITON


class CudaGraphDriver:
    """``torch.cuda`` graphs: warm-up on a side stream, capture into one shared pool."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn, num_warmup: int):
        """Run ``fn`` ``num_warmup`` times, capture it; returns ``(replay, output)``."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: JIT compiles, allocator settles
            for _ in range(num_warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out

    def synchronize(self) -> None:
        torch.cuda.synchronize()


@dataclass(slots=True)
class _Captured:
    replay: object             # () -> None
    attn: object               # GraphAttentionState
    input_ids: torch.Tensor    # [T] int64, static
    positions: torch.Tensor    # [T] int64, static
    hidden: torch.Tensor       # [T, hidden] output of the captured forward (+ the taps' columns, fp32)


class CUDAGraphRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], backend, *,
                 batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                 draft_lens: tuple[int, ...] = (0,), max_pages_per_req: int,
                 num_warmup: int = 2, driver=None) -> None:
        if driver is None:
            if not torch.cuda.is_available():
                raise ValueError("CUDAGraphRunner needs CUDA")
            if not HAS_TRITON:
                raise ValueError("CUDAGraphRunner needs triton (sync-free K/V write inside graphs)")
            driver = CudaGraphDriver()
        if not hasattr(backend, "graph_state"):
            raise ValueError(f"backend {getattr(backend, 'name', backend)!r} has no graph_state "
                             "(use the FlashInfer backend)")
        if not batch_sizes or min(batch_sizes) < 1 or not draft_lens or min(draft_lens) < 0:
            raise ValueError(f"bad buckets: batch_sizes={batch_sizes} draft_lens={draft_lens}")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.driver = driver
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        # a verify longer than a uniform group (k >= 16) runs eagerly instead of failing start-up
        self.q_lens = tuple(sorted({1 + k for k in draft_lens if 1 + k <= UNIFORM_MAX_Q_LEN}))
        self.max_pages_per_req = max_pages_per_req
        self.num_warmup = num_warmup
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.aux_layers: tuple[int, ...] | None = None  # the taps the graphs are captured with

    @classmethod
    def for_engine(cls, model, kv_caches: list[torch.Tensor], backend, *, max_num_seqs: int,
                   max_spec_tokens: int, max_model_len: int, block_size: int) -> CUDAGraphRunner:
        """The engine's buckets: batch sizes 1, 2, 4 ... 64 up to ``max_num_seqs``; k = 0 and
        ``max_spec_tokens`` (draft counts below it are padded into its bucket: adaptive and n-gram
        drafts vary per request, so one verify bucket covers every k). Not captured yet."""
        sizes = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_num_seqs)
        ks = (0, max_spec_tokens) if max_spec_tokens else (0,)
        return cls(model, kv_caches, backend, batch_sizes=sizes, draft_lens=ks,
                   max_pages_per_req=-(-max_model_len // block_size))

    # ---- drop-in model interface -----------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def set_aux_layers(self, ids: tuple[int, ...] | None) -> None:
        """EAGLE-3 taps (``engine/model/aux_states.py``; checked by the ``ModelRunner``) in graphs
        too: a captured forward with taps also writes them into its static output (``[T, hidden +
        len(ids) * hidden]``, the hidden state in fp32 beside them), so changing the taps
        recaptures every graph captured so far (start-up work, done once when the drafter is built)."""
        before, self.aux_layers = self.aux_layers, ids
        if ids != before and self.graphs:
            self.graphs = {}  # the old graphs go back to the pool before the new ones are captured
            self.capture()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                 kv_caches: list[torch.Tensor], aux_layers: tuple[int, ...] | None = None):
        """The model's forward contract (``(hidden, aux)`` with ``aux_layers``: the taps the graphs
        were captured with, ``set_aux_layers``)."""
        if kv_caches is not self.kv_caches:
            raise ValueError("CUDAGraphRunner was captured over other kv_caches")
        if aux_layers != self.aux_layers:
            raise ValueError(f"aux_layers: the graphs were captured with {self.aux_layers}, asked for {aux_layers}")
        cap = self._bucket_for(attn_metadata.qo_indptr)
        if cap is None:
            return self.model(input_ids, positions, attn_metadata, kv_caches, aux_layers=aux_layers)
        return self._replay(cap, input_ids, positions, attn_metadata)

    # ---- capture --------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse the shared pool)."""
        for q_len in reversed(self.q_lens):
            for bsz in reversed(self.batch_sizes):
                self.graphs[(bsz, q_len)] = self._capture_one(bsz, q_len)
        self.driver.synchronize()

    def _capture_one(self, bsz: int, q_len: int) -> _Captured:
        bs = self.backend.spec.block_size
        attn = self.backend.graph_state(bsz, q_len, bsz * self.max_pages_per_req)
        n = attn.num_tokens
        dev = self.backend.device
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        pos = torch.zeros(n, dtype=torch.long, device=dev)
        # A dummy batch shaped like the bucket; slots -1: nothing is written to the caches.
        md = attn.prepare(list(range(0, n + 1, q_len)), [q_len] * bsz,
                          [[0] * -(-q_len // bs)] * bsz,
                          torch.full((n,), -1, dtype=torch.long, device=dev))
        model, taps = self.model, self.aux_layers

        def forward():
            if not taps:
                return model(ids, pos, md, self.kv_caches)
            hidden, aux = model(ids, pos, md, self.kv_caches, aux_layers=taps)
            return torch.cat([hidden.float(), aux], dim=1)

        replay, out = self.driver.capture(forward, self.num_warmup)
        return _Captured(replay, attn, ids, pos, out)

    # ---- replay ---------------------------------------------------------------------------
    def _bucket_for(self, qo_indptr: list[int]) -> _Captured | None:
        b = len(qo_indptr) - 1
        if b < 1 or not self.graphs:
            return None
        longest = max(qo_indptr[i + 1] - qo_indptr[i] for i in range(b))
        q_len = next((L for L in self.q_lens if L >= longest), None)
        bsz = next((B for B in self.batch_sizes if B >= b), None)
        if q_len is None or bsz is None:
            return None
        return self.graphs.get((bsz, q_len))

    def _replay(self, cap: _Captured, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata):
        n = md.num_tokens
        cap.attn.prepare(md.qo_indptr, md.kv_lens, md.block_tables, md.slot_mapping[:n])
        dest = cap.attn.dest
        cap.input_ids.zero_()
        cap.input_ids.index_copy_(0, dest, input_ids[:n])
        cap.positions.zero_()
        cap.positions.index_copy_(0, dest, positions[:n])
        cap.replay()
        out = cap.hidden.index_select(0, dest)
        if not self.aux_layers:
            return out
        h = self.model.config.hidden_size  # the taps' columns follow the hidden state (_capture_one)
        return out[:, :h].to(self.model.dtype).contiguous(), out[:, h:].contiguous()


__all__ = ["CUDAGraphRunner", "CudaGraphDriver"]
