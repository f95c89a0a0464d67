"""ModelRunner: one SchedulerOutput -> ONE flat forward -> logits at sampling rows -> Sampler.

Prefill chunks, 1-token decodes and (1 + k)-token verifies share the batch. A request that
``needs_sample`` with k scheduled drafts gets the logits of the last 1 + k positions of its chunk;
a partial prefill chunk samples nothing (empty list in the output).

Stateless across steps: everything a request's sampling needs (parameters, seed, output count,
banned tokens, drafts and their probabilities, the committed token ids its row preparation reads)
comes in its ``ScheduledRequest``, and its random numbers are keyed by (seed, position)
(``keyed_random``). So a failed step leaves nothing to undo here and a finished request leaves
nothing to free. Prompt logprobs come from the same forward (``prompt_logprobs``). Grammar masks
come in ``SchedulerOutput.grammar_bitmask`` (the core starts them after ``schedule()``, often
beside this forward: ``engine.structured.mask_overlap``); the runner waits for them where it
applies them to the raw logits, after the forward.
"""

from __future__ import annotations

import logging

import torch

from tokenbudget.engine.model.aux_states import check_aux_layers
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.cpu_forward import c_forward_name
from tokenbudget.engine.structured.bitmask import apply_bitmask
from tokenbudget.engine.worker.input_batch import InputBatch, prepare_inputs
from tokenbudget.engine.worker.prompt_logprobs import compute_prompt_logprobs, wants_prompt_logprobs
from tokenbudget.engine.worker.sampler import SamplingRow
from tokenbudget.kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
)
from tokenbudget.kernels.attention.selector import select_attention_backend
from tokenbudget.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, config: ModelConfig, kv_caches: list[torch.Tensor], block_size: int,
                 sampler, device: torch.device | str = "cpu",
                 attn_backend: AttentionBackend | None = None, deterministic: bool = False):
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
            spec = config.attention_spec(block_size, kv_caches[0].dtype if kv_caches else torch.float32)
            attn_backend = select_attention_backend(self.device, spec, deterministic=deterministic,
                                                    attends_itself=c_forward_name(model))
        self.attn_backend = attn_backend
        self.aux_layers: tuple[int, ...] | None = None  # EAGLE-3 taps each step returns (set_aux_layers)

    # ---- one step ------------------------------------------------------------------------
    def prepare_inputs(self, sched: SchedulerOutput
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        b = self._prepare(sched)
        return b.input_ids, b.positions, b.attn_metadata, b.sample_indices

    def _prepare(self, sched: SchedulerOutput) -> InputBatch:
        return prepare_inputs(sched, self.block_size, self.attn_backend, self.device)

    def compute_logits(self, sched: SchedulerOutput) -> tuple[torch.Tensor, InputBatch]:
        """Forward + logits at the sampling rows (``[S, V]`` fp32); no sampling."""
        logits, batch, _, _ = self._forward(sched)
        return logits, batch

    def _forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, InputBatch, torch.Tensor, torch.Tensor | None]:
        """Logits at the sampling rows, the batch, the hidden state and the taps (``aux_layers``)."""
        batch = self._prepare(sched)
        aux = None
        if self.aux_layers:
            hidden, aux = self.model(batch.input_ids, batch.positions, batch.attn_metadata, self.kv_caches,
                                     aux_layers=self.aux_layers)
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata, self.kv_caches)
        if batch.sample_indices.numel() == 0:
            return hidden.new_zeros((0, self.config.vocab_size), dtype=torch.float32), batch, hidden, aux
        return self.model.compute_logits(hidden[batch.sample_indices]), batch, hidden, aux

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = [sr.request_id for sr in sched.scheduled]
        if sched.is_empty:
            return ModelRunnerOutput(req_ids, [])
        logits, batch, hidden, aux = self._forward(sched)
        prompt_logprobs = None
        if wants_prompt_logprobs(sched):
            prompt_logprobs = compute_prompt_logprobs(self.model, hidden, sched, batch.qo_indptr)
        del hidden
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[list] | None = None
        rows, owners = self._sampling_rows(sched, batch.num_samples)
        masks = sched.grammar_masks()  # computed beside the forward: ready now, or soon
        if masks:  # grammar masks on the raw logits, before p is built
            _apply_grammar_masks(logits, masks, sched, batch.num_samples)
        if rows:
            out = self.sampler(logits, rows)
            for i, toks in zip(owners, out.token_ids):
                sampled[i] = toks
            if out.logprobs is not None:
                logprobs = [[] for _ in req_ids]
                for i, lp in zip(owners, out.logprobs):
                    logprobs[i] = lp if lp is not None else []
        if self.device.type == "cuda":  # the engine's step clock (the controller's cost model) sees the device work
            torch.cuda.synchronize()
        return ModelRunnerOutput(req_ids, sampled, logprobs, prompt_logprobs, aux)

    def set_aux_layers(self, ids) -> None:
        """From the next step on, ``execute`` also returns the target's states at layers ``ids``
        (``ModelRunnerOutput.aux_hidden_states``; ``engine/model/aux_states.py``); None: stop.
        ValueError naming ``aux_layers`` for ids that are not layers of the model. A CUDA graph
        wrapper is told too (its graphs are captured with the taps)."""
        self.aux_layers = check_aux_layers(ids, self.config.num_hidden_layers)
        if hasattr(self.model, "set_aux_layers"):
            self.model.set_aux_layers(self.aux_layers)

    @staticmethod
    def _sampling_rows(sched: SchedulerOutput, num_samples: list[int]):
        """Per sampling request: its ``SamplingRow`` and its index in the batch."""
        rows, owners = [], []
        for i, (sr, m) in enumerate(zip(sched.scheduled, num_samples)):
            if not m:
                continue
            k = m - 1
            position = sr.num_computed_tokens + len(sr.token_ids) - k
            prompt, output = _context(sr, position)
            rows.append(SamplingRow(sr.params, sr.seed, position, sr.spec_token_ids, sr.spec_probs if k else None,
                                    sr.num_output_tokens, sr.banned_token_ids, prompt, output,
                                    sr.bad_words_token_ids, request_id=sr.request_id))
            owners.append(i)
        return rows, owners


def _apply_grammar_masks(logits: torch.Tensor, masks: dict, sched: SchedulerOutput, num_samples: list[int]) -> None:
    """In place: each structured request's bitmask rows onto its first sampling rows."""
    first = 0
    for sr, m in zip(sched.scheduled, num_samples):
        if m:
            bitmask = masks.get(sr.request_id)
            if bitmask is not None:
                apply_bitmask(logits, first, bitmask[:m])
            first += m


def _context(sr, num_committed: int) -> tuple[list[int], list[int]]:
    """The committed prompt and output ids, sliced only when the request's row preparation reads
    them (penalties, bad words, logits processors)."""
    params, ids = sr.params, sr.all_token_ids
    if params is None or ids is None or not (params.has_penalties or params.logits_processors
                                             or sr.bad_words_token_ids):
        return [], []
    p = sr.num_prompt_tokens
    needs_prompt = params.repetition_penalty != 1.0 or params.logits_processors
    return (ids[:p] if needs_prompt else []), ids[p:num_committed]
