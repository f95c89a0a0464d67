"""The target's forward over whole sequences, for training data: the engine's own decoder layers
(``DecoderLM.layer``, so every family the engine runs is trained on the same arithmetic rules) over
a dense batch instead of the paged cache.

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
from tokenbudget.engine.model.decoder import DecoderLM, finish_logits
from tokenbudget.kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from tokenbudget.training.precision import autocast


class _PlainLinear:
    """``F.linear`` over the model's weight: autocast applies (the serving ``Linear`` runs oneDNN's
    prepacked op, which it does not), and nothing is packed."""

    __slots__ = ("weight", "bias")
    row_multiple = 1  # training reads no bits across batches: no row padding

    def __init__(self, lin) -> None:
        self.weight, self.bias = lin.weight, lin.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class DenseCausalAttention(AttentionBackend):
    """Attention over ``B`` whole sequences of ``T`` rows each, flattened sequence-major: causal,
    with the layer's sliding window and the spec's scale and soft-cap (the semantics of
    ``kernels/attention/torch_ref.py``). K/V of the current layer are kept from ``write_kv``."""

    name = "dense_causal"

    def __init__(self, spec: AttentionSpec, batch: int, length: int) -> None:
        super().__init__(spec)
        self.b, self.t = batch, length
        self.k = self.v = None

    def build_metadata(self, qo_indptr, kv_lens, block_tables, slot_mapping) -> AttentionMetadata:
        return AttentionMetadata(list(qo_indptr), list(kv_lens), block_tables, slot_mapping, qo_indptr[-1], None, self)

    def write_kv(self, k, v, kv_cache, metadata) -> None:
        self.k, self.v = k, v

    def attend(self, q, kv_cache, metadata, window: int = 0, sinks=None) -> torch.Tensor:
        s, (b, t) = self.spec, (self.b, self.t)
        rep = s.num_heads // s.num_kv_heads

        def heads(x: torch.Tensor, n: int) -> torch.Tensor:  # [B*T, n, D] -> [B, H, T, D]
            return x.view(b, t, n, s.head_dim).repeat_interleave(rep if n != s.num_heads else 1, 2).transpose(1, 2)

        qh, kh, vh = heads(q, s.num_heads), heads(self.k, s.num_kv_heads), heads(self.v, s.num_kv_heads)
        i = torch.arange(t)
        visible = i[None, :] <= i[:, None]
        if window:
            visible &= i[None, :] > i[:, None] - window
        if s.logits_soft_cap is None and sinks is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=s.softmax_scale)
        else:
            scores = (qh @ kh.transpose(-1, -2)) * s.softmax_scale
            if s.logits_soft_cap is not None:
                scores = torch.tanh(scores / s.logits_soft_cap) * s.logits_soft_cap
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is not None:  # a per-head logit in each softmax's denominator, then dropped
                sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(b, -1, t, 1)
                probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            out = probs.to(vh.dtype) @ vh
        return out.transpose(1, 2).reshape(b * t, s.num_heads, s.head_dim)


class TapForward:
    """``__call__(ids [B, T]) -> (aux [B, T, len(taps) * H], final hidden [B, T, H] after the
    final norm, or None with ``final=False``: then the layers past the last tap are skipped)``;
    ``logits(final)`` applies the LM head (with the family's final scaling / soft-cap).
    ``precision`` (``training.precision``, resolved): the matmuls' arithmetic; outputs are float32
    either way."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], taps: tuple[int, ...],
                 precision: str = "float32"):
        if not taps or any(not 0 <= i < config.num_hidden_layers for i in taps) or list(taps) != sorted(taps):
            raise ValueError(f"taps: ascending layer ids in 0..{config.num_hidden_layers - 1}, got {taps}")
        self.config, self.taps, self.precision = config, tuple(taps), precision
        self.model = DecoderLM(config, {k: v.float() for k, v in state.items()})
        for lw in self.model.layers:
            lw.map_linears(_PlainLinear)
        self.embed = self.model.embed
        self.lm_head = self.model.lm_head.weight

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, final: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        with autocast(self.precision):
            aux, out = self._forward(ids, final)
        return aux.float(), None if out is None else out.float()

    def _forward(self, ids: torch.Tensor, final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.model
        b, t = ids.shape
        m.reserve_positions(t)
        backend = DenseCausalAttention(self.config.attention_spec(1, torch.float32), b, t)
        md = backend.build_metadata(list(range(0, b * t + 1, t)), [t] * b, [[] for _ in range(b)],
                                    torch.empty(0, dtype=torch.long))
        positions = torch.arange(t).repeat(b)
        rotations = {id(r): r.lookup(positions) for r in m.ropes.values()}
        rotations[id(None)] = None  # a NoPE layer
        h = m.embed_tokens(ids.reshape(-1))
        taps = []
        for layer, lw in enumerate(m.layers):
            if layer in self.taps:
                taps += [h] * self.taps.count(layer)  # a small target may tap one layer twice
                if not final and layer == self.taps[-1]:
                    return torch.cat(taps, dim=-1).view(b, t, -1), None
            h = m.layer(lw, h, rotations[id(lw.rope)], md, None)
        return torch.cat(taps, dim=-1).view(b, t, -1), m.rms_norm(h, m.norm, m.eps).view(b, t, -1)

    @torch.inference_mode()
    def logits(self, final: torch.Tensor) -> torch.Tensor:
        return finish_logits(F.linear(final, self.lm_head), self.config)
