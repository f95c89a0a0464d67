"""Rotary position embeddings: inverse frequencies for the HF ``rope_type`` variants and a
precomputed cos/sin table indexed by absolute position (so a position's rotation is the same
bits whatever batch it is in).

Supported ``rope_scaling["rope_type"]`` (or legacy ``"type"``): default, linear, llama3, yarn,
dynamic, longrope; and a partial rotary factor (RoPE on the first ``rotary_dim`` dims of a head,
the rest passed through: Phi-4-mini). Formulas follow transformers' ``modeling_rope_utils`` (5.x)
so logits match closely. Two of them depend on the running sequence length in transformers, which
a paged cache cannot follow (keys already in the cache keep the rotation they were written with),
so a position's rotation here is fixed:

* ``dynamic`` (NTK): transformers rescales only once a sequence grows past
  ``max_position_embeddings``; the engine never runs a position past it, so the table is the
  default one, the same rotation transformers applies to every sequence that fits.
* ``longrope`` (Phi-3 long-context): transformers rotates every position with ``short_factor``
  while the sequence fits ``original_max_position_embeddings`` and with ``long_factor`` once it is
  longer; here position p < original uses the short factors and p >= original the long ones
  (vLLM's choice), identical to transformers for every sequence within the original length.

The table covers ``positions`` (4096 by default) and grows by ``reserve(n)``, up to
``max_position_embeddings``: the engine reserves its ``max_model_len``, so a file's context length
(2**40 in a hostile one) never sizes an allocation by itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch

INITIAL_POSITIONS = 4096  # the table's size until the engine reserves its max_model_len


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _need(rs: dict[str, Any], key: str) -> Any:
    if rs.get(key) is None:
        raise ValueError(f"rope_scaling of type {rope_type_of(rs)!r} needs rope_scaling.{key}")
    return rs[key]


def check_rope_scaling(rope_scaling: dict[str, Any] | None, rotary_dim: int) -> None:
    """ValueError naming the key when ``rope_scaling`` cannot be run (at load, before any table)."""
    rs = rope_scaling or {}
    kind = rope_type_of(rope_scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if kind in ("linear", "dynamic", "llama3") and not float(_need(rs, "factor")) > 0:
        raise ValueError(f"rope_scaling.factor must be positive, got {rs['factor']!r}")
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            _need(rs, key)
        if not rs["high_freq_factor"] > rs["low_freq_factor"]:
            raise ValueError("rope_scaling.high_freq_factor must be larger than low_freq_factor")
    if kind in ("yarn", "longrope"):
        if not int(_need(rs, "original_max_position_embeddings")) > 0:
            raise ValueError("rope_scaling.original_max_position_embeddings must be positive")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            f = _need(rs, key)
            if not isinstance(f, (list, tuple)) or len(f) != rotary_dim // 2:
                raise ValueError(f"rope_scaling.{key} must list rotary_dim / 2 = {rotary_dim // 2} factors")


def compute_inv_freq(rotary_dim: int, theta: float, rope_scaling: dict[str, Any] | None,
                     max_position_embeddings: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [rotary_dim // 2] fp32, attention_scaling)``; ``long``: longrope's long
    factors (positions past ``original_max_position_embeddings``)."""
    rs = rope_scaling or {}
    kind = rope_type_of(rope_scaling)
    check_rope_scaling(rope_scaling, rotary_dim)
    dim = rotary_dim
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (theta ** exps)
    if kind in ("default", "dynamic"):  # dynamic: see the module doc
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rs["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rs), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, rs, max_position_embeddings)
    return _longrope(dim, theta, rs, max_position_embeddings, long)


def _longrope(dim: int, base: float, rs: dict[str, Any], max_pos: int, long: bool) -> tuple[torch.Tensor, float]:
    orig = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or max_pos / orig
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base ** shape), float(attention_factor)


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
    """cos/sin ``[positions, rotary_dim]`` (HF's ``cat(freqs, freqs)`` layout) in the model dtype;
    a head's dims past ``rotary_dim`` pass through unrotated."""

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None,
                 max_position_embeddings: int, dtype: torch.dtype, device: torch.device | str,
                 rotary_dim: int | None = None, positions: int = INITIAL_POSITIONS):
        self.head_dim, self.rotary_dim = head_dim, rotary_dim or head_dim
        self.theta, self.rope_scaling = theta, rope_scaling
        self.max_position_embeddings = max_position_embeddings
        self.dtype, self.device = dtype, torch.device(device)
        self.half = self.rotary_dim // 2
        check_rope_scaling(rope_scaling, self.rotary_dim)
        self.max_pos = 0
        self.cos = self.sin = torch.empty(0, self.rotary_dim, dtype=dtype, device=self.device)
        self.reserve(positions)

    def reserve(self, positions: int) -> None:
        """Make the table cover positions ``[0, positions)`` (at most ``max_position_embeddings``).
        Grows only; call it before a forward captures the table's address (CUDA graphs)."""
        n = min(positions, self.max_position_embeddings)
        if n <= self.max_pos:
            return
        pos = torch.arange(n, dtype=torch.float32)
        inv_freq, scaling = compute_inv_freq(self.rotary_dim, self.theta, self.rope_scaling,
                                             self.max_position_embeddings)
        freqs = pos[:, None] * inv_freq[None, :]
        if rope_type_of(self.rope_scaling) == "longrope":  # past the original length: the long factors
            orig = int(self.rope_scaling["original_max_position_embeddings"])
            long_freq, _ = compute_inv_freq(self.rotary_dim, self.theta, self.rope_scaling,
                                            self.max_position_embeddings, long=True)
            freqs[orig:] = pos[orig:, None] * long_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=self.dtype, device=self.device)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: the sign lives in the table.
        sin = emb.sin() * scaling
        sin[:, :self.half].neg_()
        self.sin = sin.to(dtype=self.dtype, device=self.device)
        self.max_pos = n

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> cos, signed sin ``[T, 1, rotary_dim]`` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, head_dim]``: HF's ``x * cos + rotate_half(x) * sin`` in three ops (q and
        k heads go through one call), on the first ``rotary_dim`` dims of each head."""
        if self.rotary_dim == self.head_dim:
            return torch.addcmul(x * cos, torch.roll(x, self.half, -1), sin)
        r = x[..., :self.rotary_dim]
        return torch.cat((torch.addcmul(r * cos, torch.roll(r, self.half, -1), sin), x[..., self.rotary_dim:]), -1)
