"""ModelRunner: one SchedulerOutput -> ONE flat forward -> logits at sampling rows -> Sampler.

Prefill chunks, 1-token decodes and (1 + k)-token verifies share the batch. A request that
``needs_sample`` with k scheduled drafts gets the logits of the last 1 + k positions of its chunk;
a partial prefill chunk samples nothing (empty list in the output).

Per-request state, keyed by request id:
* a ``torch.Generator`` seeded from ``params.seed`` (only when a seed is given; None = the global
  RNG), created on first sight, kept across preemption, dropped when the id appears in
  ``sched.finished_request_ids``;
* draft probabilities set by a model drafter with :meth:`set_draft_probs` for the NEXT step; the
  first ``len(scheduled drafts)`` rows are used, and every stored entry is discarded after the
  step (used or not).
"""

from __future__ import annotations

import logging
import time

import torch

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.worker.input_batch import InputBatch, prepare_inputs
from tokenbudget.engine.worker.min_tokens import apply_min_tokens
from tokenbudget.kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
)
from tokenbudget.kernels.attention.selector import select_attention_backend
from tokenbudget.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def _sampler_types():
    from tokenbudget.engine.worker.sampler import (
        SamplingRow,  # late import: keeps this module importable alone
    )
    return SamplingRow


class ModelRunner:
    def __init__(self, model, config: ModelConfig, kv_caches: list[torch.Tensor], block_size: int,
                 sampler, device: torch.device | str = "cpu",
                 attn_backend: AttentionBackend | None = None):
        if len(kv_caches) != config.num_hidden_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {config.num_hidden_layers} layers")
        if kv_caches and kv_caches[0].shape[2] != block_size:
            raise ValueError(f"kv cache block size {kv_caches[0].shape[2]} != block_size {block_size}")
        self.model = model
        self.config = config
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = torch.device(device)
        if attn_backend is None:
            spec = AttentionSpec(config.num_attention_heads, config.num_key_value_heads,
                                 config.resolved_head_dim, block_size,
                                 kv_caches[0].dtype if kv_caches else torch.float32)
            attn_backend = select_attention_backend(self.device, spec)
        self.attn_backend = attn_backend
        self.generators: dict[str, torch.Generator | None] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.last_step: tuple[int, float] | None = None

    # ---- per-request state -------------------------------------------------------------
    def set_draft_probs(self, req_id: str, probs: torch.Tensor) -> None:
        """Drafter probabilities ``[k, V]`` for ``req_id``'s drafts of the next step."""
        if probs.dim() != 2:
            raise ValueError(f"draft probs must be [k, V], got shape {tuple(probs.shape)}")
        self._draft_probs[req_id] = probs

    def _generator(self, req_id: str, params) -> torch.Generator | None:
        if req_id not in self.generators:
            seed = getattr(params, "seed", None)
            gen = None
            if seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(int(seed))
            self.generators[req_id] = gen
        return self.generators[req_id]

    # ---- one step ------------------------------------------------------------------------
    def prepare_inputs(self, sched: SchedulerOutput
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        b = self._prepare(sched)
        return b.input_ids, b.positions, b.attn_metadata, b.sample_indices

    def _prepare(self, sched: SchedulerOutput) -> InputBatch:
        return prepare_inputs(sched, self.block_size, self.attn_backend, self.device)

    def compute_logits(self, sched: SchedulerOutput) -> tuple[torch.Tensor, InputBatch]:
        """Forward + logits at the sampling rows (``[S, V]`` fp32); no sampling."""
        batch = self._prepare(sched)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata, self.kv_caches)
        if batch.sample_indices.numel() == 0:
            return hidden.new_zeros((0, self.config.vocab_size), dtype=torch.float32), batch
        return self.model.compute_logits(hidden[batch.sample_indices]), batch

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_request_ids:
            self.generators.pop(rid, None)
            self._draft_probs.pop(rid, None)
        req_ids = [sr.request_id for sr in sched.scheduled]
        if sched.is_empty:
            self._draft_probs.clear()
            return ModelRunnerOutput(req_ids, [])
        start = time.perf_counter()
        try:
            logits, batch = self.compute_logits(sched)
            sampled: list[list[int]] = [[] for _ in req_ids]
            logprobs: list[list] | None = None
            rows, owners = self._sampling_rows(sched, batch.num_samples)
            apply_min_tokens(logits, sched, batch.num_samples)
            if rows:
                out = self.sampler(logits, rows)
                for i, toks in zip(owners, out.token_ids):
                    sampled[i] = list(toks)
                if out.logprobs is not None:
                    logprobs = [[] for _ in req_ids]
                    for i, lp in zip(owners, out.logprobs):
                        logprobs[i] = lp if lp is not None else []
        finally:
            self._draft_probs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        # (tokens, seconds) of this step, for the adaptive controller's cost model.
        self.last_step = (sched.total_num_scheduled_tokens, time.perf_counter() - start)
        return ModelRunnerOutput(req_ids, sampled, logprobs)

    def _sampling_rows(self, sched: SchedulerOutput, num_samples: list[int]):
        sampling_row = _sampler_types()
        rows, owners = [], []
        for i, (sr, m) in enumerate(zip(sched.scheduled, num_samples)):
            if not m:
                continue
            params = sr.request.sampling_params
            k = m - 1
            q = self._draft_probs.get(sr.request_id)
            if q is not None and k:
                if q.shape[0] < k:
                    raise ValueError(f"request {sr.request_id}: {q.shape[0]} draft prob rows "
                                     f"for {k} scheduled drafts")
                q = q[:k]
            else:
                q = None
            rows.append(sampling_row(params, self._generator(sr.request_id, params),
                                     list(sr.spec_token_ids), q))
            owners.append(i)
        return rows, owners
