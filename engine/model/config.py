"""Architecture description of a Llama-family model (Llama, Mistral, Qwen2, SmolLM2).

Field names follow Hugging Face ``config.json``; the loaders fill it from config.json or from
GGUF metadata. State dicts that go with it use Hugging Face parameter names
(``model.layers.{i}.self_attn.q_proj.weight`` ...), whatever the file format.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str = "llama"  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)
