"""The tap states as the engine serves them: one prefill per conversation through ``ModelRunner``.

The head trains on ``TapForward``'s states (float32, or with bfloat16 matmuls:
``training.precision``); at serving time it reads the states of the engine's own forward (for the
default model: int4 weights on the C decoder forward, asked for the taps, Contract 3 of
issue 27). Evaluating the head on these too says whether what was measured on the training side
holds where it runs.
"""

from __future__ import annotations

import torch

from tokenbudget.engine.loader.target import load_target_model
from tokenbudget.engine.model.eagle3 import default_aux_layer_ids
from tokenbudget.engine.worker.kv_cache_alloc import allocate_kv_caches
from tokenbudget.engine.worker.model_runner import ModelRunner
from tokenbudget.scheduler.output import ScheduledRequest, SchedulerOutput
from tokenbudget.training.features import FeatureSet


def engine_states(model_path: str | None, like: FeatureSet, block_size: int = 16) -> tuple[FeatureSet, str]:
    """``like`` with its ``aux`` replaced by the engine's tap states of the same tokens (the
    engine's default dtype and quantization); also returns the quantization used."""
    target = load_target_model(model_path)
    model, cfg = target.model, target.config
    taps = tuple(default_aux_layer_ids(cfg.num_hidden_layers))
    longest = max((like.length(i) for i in range(len(like))), default=1)
    blocks = -(-longest // block_size)
    runner = ModelRunner(model, cfg, allocate_kv_caches(cfg, blocks, block_size, target.dtype, target.device),
                         block_size, None, device=target.device)
    aux = []
    with torch.inference_mode():
        for i in range(len(like)):
            s, n = int(like.offsets[i]), like.length(i)
            tokens = like.tokens[s:s + n].tolist()
            sr = ScheduledRequest(request_id=f"c{i}", num_computed_tokens=0, token_ids=tokens, spec_token_ids=[],
                                  block_ids=list(range(-(-n // block_size))), is_new=True, needs_sample=False)
            ids, pos, md, _ = runner.prepare_inputs(SchedulerOutput([sr], total_num_scheduled_tokens=n))
            _, states = model(ids, pos, md, runner.kv_caches, aux_layers=taps)
            aux.append(states.float().cpu().to(torch.float16))
    return FeatureSet(like.tokens, torch.cat(aux), like.offsets, like.prompt_lens, like.kinds), target.quantization
