"""ModelRunner: one SchedulerOutput -> ONE flat forward -> logits at sampling rows -> Sampler.

Prefill chunks, 1-token decodes and (1 + k)-token verifies share the batch. A request that
``needs_sample`` with k scheduled drafts gets the logits of the last 1 + k positions of its chunk;
a partial prefill chunk samples nothing (empty list in the output).

Stateless across steps: everything a request's sampling needs (parameters, seed, output count,
banned tokens, drafts and their probabilities) comes in its ``ScheduledRequest``, and its random
numbers are keyed by (seed, position) (``keyed_random``). So a failed step leaves nothing to
undo here and a finished request leaves nothing to free.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.worker.input_batch import InputBatch, prepare_inputs
from tokenbudget.engine.worker.logits_processing import apply_row_bans
from tokenbudget.engine.worker.sampler import SamplingRow
from tokenbudget.kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
)
from tokenbudget.kernels.attention.selector import select_attention_backend
from tokenbudget.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, config: ModelConfig, kv_caches: list[torch.Tensor], block_size: int,
                 sampler, device: torch.device | str = "cpu",
                 attn_backend: AttentionBackend | None = None, structured=None):
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
        # engine.structured.manager.StructuredOutputs: grammar masks on the sampling rows.
        self.structured = structured
        # (tokens, seconds) of the last step, for the draft-length controller's cost model.
        self.last_step: tuple[int, float] | None = None

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
        req_ids = [sr.request_id for sr in sched.scheduled]
        if sched.is_empty:
            return ModelRunnerOutput(req_ids, [])
        start = time.perf_counter()
        logits, batch = self.compute_logits(sched)
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[list] | None = None
        rows, owners, bans = self._sampling_rows(sched, batch.num_samples)
        apply_row_bans(logits, bans)
        if self.structured is not None:
            self.structured.apply_masks(logits, bans)
        if rows:
            out = self.sampler(logits, rows)
            for i, toks in zip(owners, out.token_ids):
                sampled[i] = toks
            if out.logprobs is not None:
                logprobs = [[] for _ in req_ids]
                for i, lp in zip(owners, out.logprobs):
                    logprobs[i] = lp if lp is not None else []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.last_step = (sched.total_num_scheduled_tokens, time.perf_counter() - start)
        return ModelRunnerOutput(req_ids, sampled, logprobs)

    @staticmethod
    def _sampling_rows(sched: SchedulerOutput, num_samples: list[int]):
        """Per sampling request: its ``SamplingRow``, its index in the batch, its row span."""
        rows, owners, bans = [], [], []
        first = 0
        for i, (sr, m) in enumerate(zip(sched.scheduled, num_samples)):
            if not m:
                continue
            k = m - 1
            position = sr.num_computed_tokens + len(sr.token_ids) - k
            rows.append(SamplingRow(sr.params, sr.seed, position, sr.spec_token_ids,
                                    sr.spec_probs if k else None))
            owners.append(i)
            bans.append((first, m, sr))
            first += m
        return rows, owners, bans
