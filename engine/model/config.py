"""Architecture description of a decoder-only model: the Llama shape plus the switches the other
families set (Qwen3, Gemma 2/3, Phi-3/4, OLMo 2, Granite, Mistral, Qwen2, Llama 3.x).

Field names follow Hugging Face ``config.json`` where one exists; the loaders fill the struct from
config.json (``engine/loader/hf_config.py``) or from GGUF metadata (``engine/loader/gguf_config.py``).
State dicts that go with it use Hugging Face parameter names (``model.layers.{i}.self_attn.q_proj
.weight`` ...), whatever the file format; ``engine/model/weights.py`` reads them per family.

Each switch is a few lines in ``engine/model/decoder.py`` and defaults to the Llama behaviour, so a
Llama config sets none of them. A value the model cannot run exactly is refused here, naming the
field (never a silently different model).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from tokenbudget.kernels.attention.base import AttentionSpec

HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "swiglu_oai")
MOE_ROUTERS = ("softmax_topk", "topk_softmax")
QK_NORMS = ("none", "head", "proj")
NORM_LAYOUTS = ("pre", "sandwich", "post")
LAYER_TYPES = ("full_attention", "sliding_attention")


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str = "llama"  # the HF model_type (or GGUF architecture) it was read from
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # always carries "rope_type" (None: plain RoPE)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims only (Phi-4-mini)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama/Granite/Qwen3 attention_bias)
    o_proj_bias: bool = False     # the output projection too (Llama/Granite/Qwen3 attention_bias)
    mlp_bias: bool = False        # gate/up/down carry biases (Llama/Granite mlp_bias)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # ---- the switches (defaults: Llama) --------------------------------------------------------
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_pytorch_tanh (Gemma)
    # q/k RMSNorm before RoPE: "head" = over each head's head_dim (Qwen3, Gemma 3), "proj" = over the
    # whole q (H*D) and k (Hk*D) projection (OLMo 2)
    qk_norm: str = "none"
    # "pre": norm -> attn/MLP -> add (Llama); "sandwich": pre AND post norms (Gemma 2/3);
    # "post": attn/MLP -> norm -> add, no pre norms (OLMo 2)
    norm_layout: str = "pre"
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + w): 1.0 for Gemma, folded at load
    embedding_multiplier: float = 1.0  # embeddings * m (Granite; Gemma: sqrt(hidden_size))
    residual_multiplier: float = 1.0   # x + m * block(x) (Granite)
    attention_scale: float | None = None  # softmax scale; None = head_dim ** -0.5 (Granite, Gemma)
    logits_scaling: float = 1.0        # logits / logits_scaling (Granite)
    attn_logit_softcapping: float | None = None   # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    sliding_window: int | None = None  # a sliding layer's query sees its last `sliding_window` keys
    layer_types: tuple[str, ...] | None = None  # per layer: full_attention | sliding_attention
    # RoPE of the sliding layers where it differs from the full layers' (Gemma 3: base 10k, no scaling)
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    nope_layers: tuple[int, ...] = ()  # layers that apply no RoPE at all (SmolLM3's NoPE layers)
    attention_sinks: bool = False  # a learned per-head logit in each softmax's denominator (gpt-oss)
    # ---- mixture of experts (engine/model/moe.py); num_experts 0: a dense model ------------------
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # an expert's intermediate size (0: intermediate_size)
    moe_layers: tuple[int, ...] | None = None  # the layers with experts (None: every layer)
    moe_router: str = "softmax_topk"  # softmax_topk (Mixtral, Qwen-MoE) | topk_softmax (gpt-oss)
    norm_topk_prob: bool = True  # renormalise the top k probabilities to sum 1 (softmax_topk)
    shared_expert_intermediate_size: int = 0  # a sigmoid-gated shared expert beside them (Qwen2-MoE)
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU (hidden_act swiglu_oai)
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.head_dim < 0 or self.resolved_head_dim <= 0 or self.resolved_head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number, got {self.resolved_head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        for name, allowed in (("hidden_act", HIDDEN_ACTS), ("qk_norm", QK_NORMS), ("norm_layout", NORM_LAYOUTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} is not supported (supported: {', '.join(allowed)})")
        rot = self.resolved_head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rot != int(rot) or int(rot) % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor!r} must give an even number of "
                             f"rotary dims in (0, head_dim={self.resolved_head_dim}]")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ValueError(f"rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        for name in ("rope_theta", "embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_scale",
                     "attn_logit_softcapping", "final_logit_softcapping", "sliding_rope_theta"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"num_hidden_layers={self.num_hidden_layers}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"layer_types {bad} not supported (supported: {', '.join(LAYER_TYPES)})")
        if any(not 0 <= i < self.num_hidden_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {list(self.nope_layers)} must be layer ids below {self.num_hidden_layers}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok!r} must be in 1..num_experts="
                                 f"{self.num_experts}")
            if self.moe_router not in MOE_ROUTERS:
                raise ValueError(f"moe_router {self.moe_router!r} is not supported "
                                 f"(supported: {', '.join(MOE_ROUTERS)})")
            if self.moe_layers is not None and any(not 0 <= i < self.num_hidden_layers for i in self.moe_layers):
                raise ValueError(f"moe_layers {list(self.moe_layers)} must be layer ids below {self.num_hidden_layers}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window!r}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def layer_window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees, itself included (0: all of its context). A layer is
        sliding when ``layer_types`` says so, or, without ``layer_types``, whenever
        ``sliding_window`` is set (Mistral, Phi-3: every layer)."""
        if self.sliding_window is None or self.sliding_window >= self.max_position_embeddings:
            return 0  # (a window over the whole context, Phi-4-mini's 262144, is no window)
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else 0

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """``(rope_theta, rope_scaling)`` of ``layer``: the sliding layers' own where one is set."""
        if self.sliding_rope_theta is not None and self.layer_window(layer):
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    def first_layers(self, n: int) -> ModelConfig:
        """This config cut to its first ``n`` layers (the self-drafter's)."""
        types = None if self.layer_types is None else self.layer_types[:n]
        moe = None if self.moe_layers is None else tuple(i for i in self.moe_layers if i < n)
        return msgspec.structs.replace(self, num_hidden_layers=n, layer_types=types, moe_layers=moe,
                                       nope_layers=tuple(i for i in self.nope_layers if i < n))

    def attention_spec(self, block_size: int, dtype) -> AttentionSpec:
        """What an attention backend needs to know of this model (one spec for every layer; a
        layer passes its own window to ``attend``)."""
        windows = tuple(sorted({w for w in map(self.layer_window, range(self.num_hidden_layers)) if w}))
        return AttentionSpec(self.num_attention_heads, self.num_key_value_heads, self.resolved_head_dim,
                             block_size, dtype, scale=self.attention_scale,
                             logits_soft_cap=self.attn_logit_softcapping, sliding_windows=windows,
                             sinks=self.attention_sinks)
