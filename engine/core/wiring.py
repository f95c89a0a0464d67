"""The *wire* half of start-up: around a loaded ``TargetModel``, size the KV pool and build the
scheduler, runner, speculator and output processor (``engine.loader.target`` is the load half).

Everything derived here (``max_model_len``, number of KV blocks, threads) is computed from the
frozen ``EngineConfig`` plus the model and the machine, and logged once.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

from tokenbudget.api.config import EngineConfig
from tokenbudget.api.spec_config import SpeculativeConfig
from tokenbudget.engine.core.engine_core import EngineCore
from tokenbudget.engine.core.output_processor import OutputProcessor
from tokenbudget.engine.drafters.factory import build_speculator
from tokenbudget.engine.loader.target import TargetModel, load_target_model
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.cpu_forward import kernels_summary
from tokenbudget.engine.structured.manager import StructuredOutputs
from tokenbudget.engine.worker.host_memory import resident_memory_bytes
from tokenbudget.engine.worker.kv_cache_alloc import (
    allocate_kv_caches,
    default_kv_cache_bytes,
    num_blocks_for_budget,
)
from tokenbudget.engine.worker.model_runner import ModelRunner
from tokenbudget.engine.worker.sampler import Sampler
from tokenbudget.engine.worker.threads import set_torch_threads
from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.scheduler import Scheduler
from tokenbudget.spec.speculator import Speculator

logger = logging.getLogger("tokenbudget")

@dataclass(slots=True)
class WiredEngine:
    """An engine's parts: the step loop and the loaded model it runs."""

    core: EngineCore
    target: TargetModel
    spec_config: SpeculativeConfig | None


def load_and_wire(config: EngineConfig, target: TargetModel | None = None) -> WiredEngine:
    """Load the target (unless given) and wire an engine around it."""
    spec_config = config.spec_config
    threads = set_torch_threads(config.num_threads)
    if target is None:
        target = load_target_model(config.model, dtype=config.dtype, device=config.device,
                                   quantization=config.quantization, revision=config.revision)
    else:
        check_target_matches(config, target)
    return wire_engine(config, target, spec_config, threads)


def check_target_matches(config: EngineConfig, target: TargetModel) -> None:
    """A pre-loaded target must agree with the options that would have loaded it."""
    for name, got in (("dtype", str(target.dtype).removeprefix("torch.")), ("device", target.device.type)):
        want = getattr(config, name)
        if want != "auto" and want != got:
            raise ValueError(f"{name}={want!r} but the given model was loaded with {name}={got!r}")
    if config.quantization not in ("auto", target.quantization):
        raise ValueError(f"quantization={config.quantization!r} but the given model was loaded with "
                         f"quantization={target.quantization!r}")


def wire_engine(config: EngineConfig, target: TargetModel, spec_config: SpeculativeConfig | None,
                threads: int) -> WiredEngine:
    mcfg, model, device, dtype = target.config, target.model, target.device, target.dtype
    # A model drafter keeps its own KV cache over the same block ids: the budget pays for both.
    draft_share = _draft_kv_share(spec_config, mcfg)
    kv_bytes = config.kv_cache_memory_bytes or default_kv_cache_bytes(
        mcfg, config.block_size, dtype, device, config.max_num_seqs, config.max_model_len)
    num_blocks = num_blocks_for_budget(mcfg, config.block_size, dtype, int(kv_bytes / (1.0 + draft_share)))
    max_model_len = config.max_model_len or min(mcfg.max_position_embeddings, num_blocks * config.block_size)
    if max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context "
                         f"({mcfg.max_position_embeddings} positions)")
    model.reserve_positions(max_model_len)  # RoPE tables cover the engine's positions (sized here, not by the file)
    lookahead = spec_config.max_spec_tokens if spec_config is not None and spec_config.uses_draft_kv else 0
    sched_config = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len, block_size=config.block_size, num_blocks=num_blocks,
        enable_prefix_caching=config.enable_prefix_caching, policy=config.scheduling_policy,
        long_prefill_token_threshold=config.long_prefill_token_threshold, num_lookahead_tokens=lookahead)
    scheduler = Scheduler(sched_config)
    kv_caches = allocate_kv_caches(mcfg, num_blocks, config.block_size, dtype, device)
    if config.deterministic:
        from tokenbudget.engine.worker.deterministic import apply_deterministic_mode
        apply_deterministic_mode(model, device)
    structured = StructuredOutputs(target.tokenizer, mcfg.vocab_size, config.max_grammar_mask_ms,
                                   config.max_batch_grammar_mask_ms)
    runner = ModelRunner(model, mcfg, kv_caches, config.block_size, Sampler(), device,
                         deterministic=config.deterministic)
    if spec_config is not None:  # decodes and verifies of a request on one attention tile
        runner.attn_backend.align_tiles(1 + spec_config.max_spec_tokens)
    if config.cuda_graphs:
        _wrap_in_cuda_graphs(runner, kv_caches, spec_config, max_model_len, config)
    speculator = build_speculator(spec_config, target, scheduler, runner) if spec_config else Speculator()
    core = EngineCore(scheduler, runner, speculator, OutputProcessor(target.tokenizer), structured=structured)
    gc.collect()
    gc.freeze()  # start-up objects (weights' Python wrappers, tokenizer) leave the GC's scans
    rss = resident_memory_bytes()
    kernels = kernels_summary(model) if device.type == "cpu" else device.type
    total, active = model.num_parameters
    params = f"{total / 1e6:.1f}M params" + (f", {active / 1e6:.1f}M active" if active != total else "")
    logger.info("tokenbudget: %s (%s, %s) on %s (%s, quantization=%s, kernels: %s, %d threads), max_model_len=%d, "
                "%d KV blocks of %d tokens (%.2f GiB), speculation=%s, RSS %s", target.source, mcfg.architecture,
                params, device, str(dtype).removeprefix("torch."), target.quantization, kernels, threads,
                max_model_len, num_blocks,
                config.block_size, kv_bytes / 2**30,
                spec_config.method if spec_config else "off", f"{rss / 2**30:.2f} GiB" if rss else "n/a")
    return WiredEngine(core, target, spec_config)


def _draft_kv_share(spec_config: SpeculativeConfig | None, mcfg: ModelConfig) -> float:
    """Drafter KV bytes per block as a fraction of the target's (same dtype and block size)."""
    if spec_config is None or not spec_config.uses_draft_kv:
        return 0.0
    if spec_config.method == "self_draft":
        return min(spec_config.draft_num_layers, mcfg.num_hidden_layers) / mcfg.num_hidden_layers
    from tokenbudget.engine.loader.kv_shape import kv_elements_per_token
    target = mcfg.num_hidden_layers * mcfg.num_key_value_heads * mcfg.resolved_head_dim
    return kv_elements_per_token(spec_config.model) / target


def _wrap_in_cuda_graphs(runner: ModelRunner, kv_caches, spec_config, max_model_len: int,
                         config: EngineConfig) -> None:
    """Swap the runner's model for a CUDA-graph wrapper (same call signature)."""
    from tokenbudget.kernels.triton_utils import HAS_TRITON
    if runner.device.type != "cuda" or runner.attn_backend.name != "flashinfer" or not HAS_TRITON:
        raise ValueError("cuda_graphs=True needs device='cuda' with flashinfer and triton installed")
    from tokenbudget.engine.worker.cuda_graphs import CUDAGraphRunner
    graphs = CUDAGraphRunner.for_engine(
        runner.model, kv_caches, runner.attn_backend, max_num_seqs=config.max_num_seqs,
        max_spec_tokens=0 if spec_config is None else spec_config.max_spec_tokens,
        max_model_len=max_model_len, block_size=config.block_size)
    graphs.capture()
    runner.model = graphs
