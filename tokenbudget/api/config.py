"""Engine options: one frozen, validated struct (a bad value raises ValueError naming the field).

Values that depend on the loaded model or the machine (the device actually used, the number of
KV blocks the memory budget buys, the effective ``max_model_len``) are derived by the engine at
start-up and never written back here.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    # HF directory, .gguf file or Hugging Face Hub id (org/name, org/name:Q8_0, org/name/file.gguf);
    # None = SmolLM2-135M-Instruct
    model: str | None = None
    revision: str | None = None  # a hub id's branch, tag or commit (huggingface_hub's revision)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # CPU fp32 only: weight-only quantized GEMMs (engine/model/quant.py); none = the float path;
    # auto = what the model file holds (a Q4_1 GGUF -> int4; HF, CUDA, bf16 -> none)
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    max_model_len: int | None = None  # None: the model's context, capped by the KV pool
    block_size: int = 16
    # KV pool size; None = sized from the model and the machine at start-up
    # (engine/worker/kv_cache_alloc.py: max_num_seqs full contexts, capped at 1/4 of the available
    # memory and 4 GiB on the CPU, where the pool only becomes resident as it fills)
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    long_prefill_token_threshold: int = 0
    speculative_config: dict[str, Any] | None = None
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default
    seed: int = 0  # seeds the global RNG used by unseeded sampled requests
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for (vLLM's); -1: no cap
    # auto: the model's recommended sampling (generation_config.json, a GGUF's general.sampling.*)
    # fills the sampling fields a request leaves unset, as vLLM's --generation-config auto;
    # none: the engine's neutral defaults (engine/loader/generation_defaults.py)
    generation_config: Literal["auto", "none"] = "auto"
    # CUDA only: capture decode/verify batches in CUDA graphs at start-up (needs FlashInfer and
    # triton). Off by default until it has been validated on a GPU (see benches/RESULTS.md).
    cuda_graphs: bool = False
    # CUDA: batch-invariant mode (engine/worker/deterministic.py): greedy speculation
    # bit-identical to plain decoding, at a speed cost. CPU is batch-invariant already.
    deterministic: bool = False
    # Admission control (``AsyncLLM`` / ``LLMEngine.add_request``): at most this many requests /
    # prompt tokens wait to run; past them a new request raises EngineOverloadedError. None = no bound.
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    # CPU milliseconds one request's grammar masks may take in one step (its first mask: at
    # admission); past it that request fails alone (engine/structured/manager.py).
    max_grammar_mask_ms: float = 10.0
    # CPU milliseconds the grammar masks of all requests may take together in a step (on average;
    # at most this plus one request's): past it the costliest wait (engine/structured/mask_budget.py).
    max_batch_grammar_mask_ms: float = 5.0
    # Admission: the estimated CPU ms of one step's masks of every structured request in flight;
    # a new structured request that would take it past this gets EngineOverloadedError (429), so
    # the costly ones cannot pile up waiting for their turns. None = no bound.
    max_grammar_mask_ms_in_flight: float | None = 100.0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_model_len", "num_threads", "max_queued_requests", "max_queued_tokens",
                     "kv_cache_memory_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no cap, got {self.max_logprobs!r}")
        for name in ("max_grammar_mask_ms", "max_batch_grammar_mask_ms", "max_grammar_mask_ms_in_flight"):
            v = getattr(self, name)
            if v is None and name == "max_grammar_mask_ms_in_flight":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold!r}")
        for name in ("cuda_graphs", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantization must be one of auto/none/int8/int4, got {self.quantization!r}")
        if self.quantization in ("int8", "int4") and (self.device == "cuda" or self.dtype not in ("auto", "float32")):
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU in float32 "
                             f"(got device={self.device!r}, dtype={self.dtype!r})")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto/float32/bfloat16/float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config must be 'auto' or 'none', got {self.generation_config!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, dict):
            raise ValueError("speculative_config must be a dict (or None)")
        spec = self.spec_config  # every key checked by SpeculativeConfig, named in its message
        if spec is not None:
            _check_spec_fits(spec, self.max_num_batched_tokens)

    @property
    def admission_control(self) -> bool:
        """True when ``max_queued_requests``, ``max_queued_tokens`` or
        ``max_grammar_mask_ms_in_flight`` bounds what is accepted."""
        return (self.max_queued_requests is not None or self.max_queued_tokens is not None
                or self.max_grammar_mask_ms_in_flight is not None)

    @property
    def spec_config(self):
        """The parsed ``speculative_config`` (a ``SpeculativeConfig``), or None."""
        if self.speculative_config is None:
            return None
        from tokenbudget.api.spec_config import SpeculativeConfig
        return SpeculativeConfig.from_dict(self.speculative_config)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        fields = set(cls.__struct_fields__)
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(fields)}")
        return cls(**kwargs)


def _check_spec_fits(spec, max_num_batched_tokens: int) -> None:
    """What ``SpeculativeConfig`` cannot check alone: its draft length against the step budget
    (a verify of k drafts is 1 + k tokens in one step; a model drafter also reserves k KV slots
    ahead) and that a draft model exists. A method's default length (suffix: the tree depth) is
    only cut to the budget, not refused."""
    k = spec.max_spec_tokens
    if 1 + k > max_num_batched_tokens and (isinstance(spec.num_speculative_tokens, int) or spec.uses_draft_kv):
        raise ValueError(f"speculative_config['num_speculative_tokens'] ({k}) + 1 exceeds max_num_batched_tokens "
                         f"({max_num_batched_tokens}): a verify step could never be scheduled")
    if spec.method == "draft_model" and not os.path.exists(os.path.expanduser(spec.model)):
        raise ValueError(f"speculative_config['model'] {spec.model!r} does not exist: pass a .gguf file or an "
                         "HF directory")
    if spec.method == "eagle3" and spec.model is not None and not os.path.isdir(os.path.expanduser(spec.model)):
        raise ValueError(f"speculative_config.model: {spec.model!r} is not a directory: pass an EAGLE-3 head "
                         "directory (config.json + *.safetensors), or omit it for the default model's head")
