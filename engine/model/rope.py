"""Rotary position embeddings: inverse frequencies for the HF ``rope_type`` variants and a
precomputed cos/sin table indexed by absolute position (so a position's rotation is the same
bits whatever batch it is in).

Supported ``rope_scaling["rope_type"]`` (or legacy ``"type"``): default, linear, llama3, yarn.
``dynamic`` / ``longrope`` depend on the running sequence length and are rejected (ValueError).
Formulas follow transformers' ``modeling_rope_utils`` (5.x) so logits match bitwise-closely.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


def compute_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None,
                     max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [head_dim // 2] fp32, attention_scaling)``."""
    rs = rope_scaling or {}
    kind = rope_type_of(rope_scaling)
    dim = int(head_dim * rs.get("partial_rotary_factor", 1.0))
    if dim != head_dim:
        raise ValueError("rope_scaling.partial_rotary_factor != 1 is not supported")
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (theta ** exps)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rs["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rs), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, rs, max_position_embeddings)
    raise ValueError(f"rope_scaling rope_type {kind!r} is not supported "
                     "(supported: default, linear, llama3, yarn)")


def _llama3(inv_freq: torch.Tensor, rs: dict[str, Any]) -> torch.Tensor:
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    inv_l = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_l)


def _yarn(dim: int, base: float, rs: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or max_pos / orig
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, float(attention_factor)


class RotaryTable:
    """cos/sin ``[max_pos, head_dim]`` (HF's ``cat(freqs, freqs)`` layout) in the model dtype."""

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None,
                 max_position_embeddings: int, dtype: torch.dtype, device: torch.device | str):
        inv_freq, scaling = compute_inv_freq(head_dim, theta, rope_scaling, max_position_embeddings)
        self.max_pos = max_position_embeddings
        pos = torch.arange(self.max_pos, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: the sign lives in the table.
        sin = emb.sin() * scaling
        sin[:, :head_dim // 2].neg_()
        self.sin = sin.to(dtype=dtype, device=device)
        self.half = head_dim // 2

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> cos, signed sin ``[T, 1, head_dim]`` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, head_dim]``: HF's ``x * cos + rotate_half(x) * sin`` in three ops (q and
        k heads go through one call)."""
        return torch.addcmul(x * cos, torch.roll(x, self.half, -1), sin)
