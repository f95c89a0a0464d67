"""A plain PyTorch forward of a Llama-family target over whole sequences, for training data.

It records what the EAGLE-3 head reads at serving time (Contract 2 of issue 27): for tap id ``i``
the residual stream at the *input* of decoder layer ``i`` (= Hugging Face
``output_hidden_states[i]``, = vLLM's ``hidden_states + residual`` before layer ``i``),
concatenated in id order; and the target's next-token distribution (top-k log-probabilities).
It is teacher-forced over prompt + response in one pass, batched over right-padded sequences
(causal attention, so padding never reaches a real row). Weights are the loader's Hugging Face
state dict (``engine.loader.load_model_files``), so it runs on any target the engine loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.rope import RotaryTable
from tokenbudget.training.precision import autocast


class TapForward:
    """``__call__(ids [B, T]) -> (aux [B, T, len(taps) * H], final hidden [B, T, H] after the
    final norm, or None with ``final=False``: then the layers past the last tap are skipped)``;
    ``logits(final)`` applies the LM head. ``precision`` (``training.precision``, resolved): the
    matmuls' arithmetic; outputs are float32 either way."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], taps: tuple[int, ...],
                 precision: str = "float32"):
        if not taps or any(not 0 <= i < config.num_hidden_layers for i in taps) or list(taps) != sorted(taps):
            raise ValueError(f"taps: ascending layer ids in 0..{config.num_hidden_layers - 1}, got {taps}")
        self.config, self.taps, self.precision = config, tuple(taps), precision
        self.w = {k: v.float() for k, v in state.items()}
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.w.get("lm_head.weight", self.embed)
        c = config
        self.head_dim = c.resolved_head_dim
        self.rope = RotaryTable(self.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings,
                                torch.float32, "cpu")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.w[name + ".weight"]
        return F.rms_norm(x, w.shape, w, self.config.rms_norm_eps)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, final: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        with autocast(self.precision):
            aux, out = self._forward(ids, final)
        return aux.float(), None if out is None else out.float()

    def _forward(self, ids: torch.Tensor, final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        c = self.config
        b, t = ids.shape
        heads, kv, d = c.num_attention_heads, c.num_key_value_heads, self.head_dim
        positions = torch.arange(t).repeat(b)
        cos, sin = self.rope.lookup(positions)
        h = F.embedding(ids, self.embed)
        taps = []
        for layer in range(c.num_hidden_layers):
            if layer in self.taps:
                taps += [h] * self.taps.count(layer)  # a small target may tap one layer twice
                if not final and layer == self.taps[-1]:
                    return torch.cat(taps, dim=-1), None
            p = f"model.layers.{layer}"
            x = self._norm(h, p + ".input_layernorm").view(b * t, -1)
            q = self._linear(x, p + ".self_attn.q_proj").view(b * t, heads, d)
            k = self._linear(x, p + ".self_attn.k_proj").view(b * t, kv, d)
            v = self._linear(x, p + ".self_attn.v_proj").view(b, t, kv, d)
            q = self.rope.apply(q, cos, sin).view(b, t, heads, d)
            k = self.rope.apply(k, cos, sin).view(b, t, kv, d)
            rep = heads // kv
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
                v.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True)
            h = h + self._linear(att.transpose(1, 2).reshape(b, t, heads * d), p + ".self_attn.o_proj")
            x = self._norm(h, p + ".post_attention_layernorm")
            h = h + self._linear(F.silu(self._linear(x, p + ".mlp.gate_proj")) * self._linear(x, p + ".mlp.up_proj"),
                                 p + ".mlp.down_proj")
        return torch.cat(taps, dim=-1), self._norm(h, "model.norm")

    @torch.inference_mode()
    def logits(self, final: torch.Tensor) -> torch.Tensor:
        return F.linear(final, self.lm_head)
