"""DraftRunner: a drafter model, its OWN paged KV cache, batched forwards on the TARGET's block tables.

The drafter's cache has the same ``num_blocks`` and ``block_size`` as the target's and is indexed
by the same block ids (``KVCacheManager.get_block_ids``), so a request's drafter KV at position p
lives in the same (block, offset) slot as its target KV, in different tensors. No block
bookkeeping of its own: the scheduler's lookahead reservation (``num_lookahead_tokens = k``) makes
room for the draft positions. A forward is a ``SchedulerOutput``-shaped batch of chunks pushed
through :func:`engine.input_batch.prepare_inputs`, exactly like the target's step.

Self-drafting (first N layers of the target): :func:`truncated_view` returns a shallow copy of
the target ``DecoderLM`` whose ``layers`` list holds the first N ``LayerWeights`` objects.
Every tensor (embeddings, layer weights, final norm, lm head, RoPE tables) is SHARED with the
target, no copy; the target's own ``forward`` / ``compute_logits`` run on the view unchanged
(``forward`` loops over ``zip(self.layers, kv_caches)`` and then applies the final norm; a layer's
window and RoPE table are on its ``LayerWeights``). ``engine/model/decoder.py`` must keep its
layer loop over ``self.layers`` for this to stay true (``test_draft_model`` checks the view against
the target's first N layers).

Memory: the drafter's KV cache is allocated on top of the target's budget
(``num_blocks * kv_cache_block_bytes(draft_config)``; for self_draft N/L of the target's KV).
"""

from __future__ import annotations

import copy

import torch

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.cpu_forward import CpuForwardModel
from tokenbudget.engine.worker.input_batch import prepare_inputs
from tokenbudget.engine.worker.kv_cache_alloc import allocate_kv_caches
from tokenbudget.kernels.attention.selector import select_attention_backend
from tokenbudget.scheduler.output import ScheduledRequest, SchedulerOutput


def truncated_view(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The target with only its first ``num_layers`` decoder layers (weights shared, not copied);
    the final norm and lm head stay."""
    layers = model.layers
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}], got {num_layers}")
    wrapped = isinstance(model, CpuForwardModel)  # a C forward is built for the layers it runs
    view = copy.copy(model.model if wrapped else model)  # new __dict__, same tensors / Linear objects
    view.layers = list(layers[:num_layers])
    return CpuForwardModel.around(view) if wrapped else view


class DraftRunner:
    """Runs drafter forwards over chunks ``(request, start position, token ids, block table)``."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.model = model
        self.config = config  # num_hidden_layers == the layers the drafter runs
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, dtype, self.device)
        self.attn_backend = select_attention_backend(self.device, config.attention_spec(block_size, dtype))

    @classmethod
    def self_draft(cls, target_model: torch.nn.Module, target_config: ModelConfig, num_layers: int,
                   num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device | str) -> DraftRunner:
        view = truncated_view(target_model, num_layers)
        cfg = target_config.first_layers(num_layers)
        return cls(view, cfg, num_blocks, block_size, dtype, device)

    @staticmethod
    def chunk(request, start: int, token_ids: list[int], block_ids: list[int],
              sample: bool) -> ScheduledRequest:
        """Positions ``[start, start + len(token_ids))`` of ``request``; logits of the last one
        are returned when ``sample``."""
        return ScheduledRequest(request_id=request.request_id, num_computed_tokens=start, token_ids=list(token_ids),
                                spec_token_ids=[], block_ids=block_ids, is_new=False, needs_sample=sample)

    def forward(self, chunks: list[ScheduledRequest]) -> torch.Tensor:
        """One flat forward; fp32 logits ``[S, V]`` for the chunks with ``needs_sample`` (in order)."""
        batch = prepare_inputs(SchedulerOutput(scheduled=chunks), self.block_size,
                               self.attn_backend, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata, self.kv_caches)
        if batch.sample_indices.numel() == 0:
            return hidden.new_zeros((0, self.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.sample_indices])
