"""Random-weight Llama engines of realistic shapes, built without any model file.

For GPU benchmarks on machines without internet (the default model's GGUF cannot travel there).
``build_synthetic_engine`` wires the REAL components (``EngineCore`` around ``Scheduler``,
``ModelRunner``, ``Sampler``, KV caches sized from a byte budget, the attention backend the
selector picks: FlashInfer on CUDA when installed) around a :class:`DecoderLM` whose
weights are generated directly on the device, one tensor at a time (no host copy of an 8B state
dict). Prompts are token ids, so no tokenizer is involved: :class:`SyntheticEngine` has
``add_request`` / ``step`` like ``LLMEngine``; its outputs are DELTA ``RequestOutput`` s (token
ids, no text).

:class:`OracleProposer` drafts the target's own greedy continuation (recorded by a run without
speculation) with per-token acceptance probability α: each drafted token is the true next token
with probability α and a wrong one otherwise (drafts after the first wrong one are never accepted,
whatever they are), so greedy verification accepts a geometric number of drafts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from tokenbudget.api.outputs import RequestOutput
from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams
from tokenbudget.api.spec_config import SpeculativeConfig
from tokenbudget.engine.core.engine_core import EngineCore
from tokenbudget.engine.core.prompts import make_request
from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.weights import expected_shapes
from tokenbudget.engine.worker.kv_cache_alloc import (
    allocate_kv_caches,
    num_blocks_for_budget,
)
from tokenbudget.engine.worker.model_runner import ModelRunner
from tokenbudget.engine.worker.sampler import Sampler
from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.scheduler.scheduler import Scheduler
from tokenbudget.spec.proposer import BaseProposer, Proposal
from tokenbudget.spec.speculator import Speculator

_COMMON = dict(architecture="llama", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)

SHAPES: dict[str, ModelConfig] = {
    # CPU smoke tests: a few MB.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        tie_word_embeddings=True, architecture="llama", max_position_embeddings=4096),
    # The default model's shape (SmolLM2-135M-Instruct) with random weights: its GGUF cannot
    # travel to an offline GPU machine inside the 64 MiB carry.
    "smollm2": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                           architecture="llama", rms_norm_eps=1e-5, rope_theta=100000.0,
                           max_position_embeddings=8192),
    # Llama-3.2-1B-like: tied embeddings, head_dim 64.
    "1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                      tie_word_embeddings=True, **_COMMON),
    # Llama-3-8B-like: untied lm_head, head_dim 128.
    "8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      tie_word_embeddings=False, **_COMMON),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def param_count(cfg: ModelConfig) -> int:
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.resolved_head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d * h
    layer = qkv + cfg.num_attention_heads * d * h + 3 * h * i + 2 * h
    return v * h * (1 if cfg.tie_word_embeddings else 2) + cfg.num_hidden_layers * layer + h


class _RandomStateDict(dict):
    """HF-named state dict whose layer tensors are generated on first access and not kept
    (``build_model`` fuses q/k/v and gate/up into new tensors, so each random tensor lives only
    while its layer is being built). Embedding / final norm / lm_head are stored eagerly."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, std: float,
                 seed: int) -> None:
        super().__init__()
        self.cfg, self.dtype, self.device, self.std = cfg, dtype, device, std
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        h, v = cfg.hidden_size, cfg.vocab_size
        self["model.embed_tokens.weight"] = self._randn((v, h))
        self["model.norm.weight"] = torch.ones(h, dtype=dtype, device=device)
        if not cfg.tie_word_embeddings:
            self["lm_head.weight"] = self._randn((v, h))

    def keys(self):
        """Every tensor the model reads (``engine.model.weights.expected_shapes``): made on access."""
        return expected_shapes(self.cfg, ()).keys()

    def _randn(self, shape) -> torch.Tensor:
        t = torch.empty(shape, dtype=self.dtype, device=self.device)
        t.normal_(0.0, self.std, generator=self.gen)
        return t

    def __missing__(self, key: str) -> torch.Tensor:
        cfg = self.cfg
        h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.resolved_head_dim
        name = key.split(".", 3)[-1] if key.startswith("model.layers.") else key
        shapes = {
            "self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
            "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
            "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
            "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            "mlp.gate_proj.weight": (i, h),
            "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i),
        }
        if name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return torch.ones(h, dtype=self.dtype, device=self.device)
        if name not in shapes:
            raise KeyError(key)
        return self._randn(shapes[name])


@dataclass
class SyntheticEngine:
    """An ``EngineCore`` over a random-weight model, fed token-id prompts."""

    model_config: ModelConfig
    model: torch.nn.Module
    core: EngineCore
    device: torch.device
    dtype: torch.dtype

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def speculator(self) -> Speculator:
        return self.core.speculator

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params = msgspec.structs.replace(params, output_kind=RequestOutputKind.DELTA)
        _, request = make_request(request_id, list(prompt_token_ids), params, 0, None, self.model_config.vocab_size)
        self.core.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return self.core.step()

    def set_speculator(self, proposer=None, k: int = 0) -> None:
        """Speculation off (``proposer=None``) or ``proposer`` with a fixed k drafts per step."""
        if proposer is None:
            self.core.speculator = Speculator()
        else:
            cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
            self.core.speculator = Speculator(cfg, proposer)


def build_synthetic_engine(shape: str | ModelConfig = "tiny", device: str | torch.device = "cpu",
                           dtype: str | torch.dtype = "float32", kv_bytes: int = 64 << 20,
                           max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                           spec_k: int = 0, acceptance: float = 1.0, block_size: int = 16,
                           max_model_len: int | None = None, std: float = 0.02,
                           seed: int = 0) -> SyntheticEngine:
    """A ready engine over a random-weight model. ``spec_k > 0`` installs an
    :class:`OracleProposer` with ``acceptance`` (give it references with ``set_references``)."""
    cfg = SHAPES[shape] if isinstance(shape, str) else shape
    device = torch.device(device)
    dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    torch.manual_seed(seed)
    sd = _RandomStateDict(cfg, dtype, device, std, seed)
    model = build_model(cfg, sd, dtype, device)
    sd.clear()
    del sd
    if device.type == "cuda":
        torch.cuda.empty_cache()
    num_blocks = num_blocks_for_budget(cfg, block_size, dtype, kv_bytes)
    mml = max_model_len or min(cfg.max_position_embeddings, num_blocks * block_size)
    sched_cfg = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                max_model_len=mml, block_size=block_size, num_blocks=num_blocks,
                                enable_prefix_caching=False)
    kv_caches = allocate_kv_caches(cfg, num_blocks, block_size, dtype, device)
    runner = ModelRunner(model, cfg, kv_caches, block_size, Sampler(), device)
    eng = SyntheticEngine(cfg, model, EngineCore(Scheduler(sched_cfg), runner), device, dtype)
    if spec_k > 0:
        eng.set_speculator(OracleProposer(acceptance, cfg.vocab_size), spec_k)
    return eng


def apply_engine_modes(eng: SyntheticEngine, *, deterministic: bool = False, cuda_graphs: bool = False,
                       max_spec_tokens: int = 0) -> None:
    """What ``EngineConfig(deterministic=..., cuda_graphs=...)`` does to a built engine, applied to
    a synthetic one: deterministic mode's batch-invariant GEMMs and single attention tile, the
    attention tiles aligned to ``1 + max_spec_tokens`` rows, then the CUDA-graph wrapper with
    buckets for k = 0 and ``max_spec_tokens`` (shorter drafts pad into it)."""
    runner = eng.runner
    if deterministic:
        from tokenbudget.engine.worker.deterministic import apply_deterministic_mode
        from tokenbudget.kernels.attention import select_attention_backend
        apply_deterministic_mode(eng.model, eng.device)
        runner.attn_backend = select_attention_backend(eng.device, runner.attn_backend.spec, deterministic=True)
    if max_spec_tokens:  # as the wiring does for a configured speculator
        runner.attn_backend.align_tiles(1 + max_spec_tokens)
    if cuda_graphs:
        from tokenbudget.engine.worker.cuda_graphs import CUDAGraphRunner
        cfg = eng.scheduler.config
        graphs = CUDAGraphRunner.for_engine(runner.model, runner.kv_caches, runner.attn_backend,
                                            max_num_seqs=cfg.max_num_seqs, max_spec_tokens=max_spec_tokens,
                                            max_model_len=cfg.max_model_len, block_size=cfg.block_size)
        graphs.capture()
        runner.model = graphs


class OracleProposer(BaseProposer):
    """Drafts the recorded greedy continuation; each token is right with probability ``acceptance``.

    ``references[request_id]`` = the request's output tokens from a run without speculation.
    A wrong draft is the true token + 1 (mod vocab), so it is never accepted by greedy verify.
    """

    def __init__(self, acceptance: float, vocab_size: int, references: dict[str, list[int]] | None = None,
                 seed: int = 0) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.references = dict(references or {})
        self.rng = random.Random(seed)

    def set_references(self, references: dict[str, list[int]]) -> None:
        self.references = dict(references)

    def propose(self, requests: Sequence, num_tokens: Sequence[int]) -> Proposal:
        out = []
        for r, k in zip(requests, num_tokens):
            ref = self.references.get(r.request_id)
            if ref is None or k <= 0:
                out.append([])
                continue
            n = r.num_output_tokens
            truth = ref[n:n + k]
            drafts = [t if self.rng.random() < self.acceptance else (t + 1) % self.vocab_size for t in truth]
            out.append(drafts)
        return Proposal(out)
