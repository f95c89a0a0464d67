"""The EAGLE-3 draft head: one decoder layer over the target's own hidden states.

Layout and forward are the ones vLLM and SGLang load (``llama_eagle3.py``), so a published head
runs unchanged and a head trained here is a published-layout checkpoint:

- ``fc [H, 3 * H_target]`` fuses the target's hidden states at one position, the residual
  stream at the INPUT of three decoder layers (= HF ``output_hidden_states[i]``; vLLM's and
  SpecForge's taps, by default i = 2, L // 2, L - 3; ``engine/model/aux_states.py``):
  ``h = fc(cat(low, mid, high))``.
- one decoder layer (``midlayer``) whose q/k/v projections read ``2 * H`` inputs, the
  concatenation ``[input_layernorm(embed(token)), hidden_norm(h)]``; residual ``h`` (or
  ``hidden_norm(h)`` with ``norm_before_residual``); then post-attention norm, SwiGLU MLP, residual.
- ``lm_head [V_draft, H]`` after ``norm``; a draft id ``d`` is target id ``d + d2t[d]``.
- The embedding is the target's (not stored in the head).

Per drafted position the head reads the previous step's *pre-norm* output as ``h`` (the first
step reads ``fc`` of the target's states): that is what lets it draft k tokens autoregressively
from one verify pass. The module owns no KV cache: attention goes through the ``attend`` callable
its caller passes (training: causal attention over a sequence; the engine: the head's own
per-request cache), so the same weights run in both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tokenbudget.engine.model.rope import RotaryTable

# attend(q [Q, heads, D], k [T, kv_heads, D], v [T, kv_heads, D]) -> [Q, heads * D]: Q = T, or the
# rows ``out_rows`` of ``Eagle3Head.forward`` (the attend is built knowing which)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default taps for an L-layer target: layers 2, L // 2 and L - 3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """The head's shape; ``to_hf`` / ``from_hf`` read and write the published ``config.json``."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int            # the target's vocabulary
    draft_vocab_size: int      # rows of lm_head
    aux_layer_ids: tuple[int, int, int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    norm_before_residual: bool = False
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys, kept on save

    def __post_init__(self) -> None:
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids: EAGLE-3 taps 3 target layers, got {self.aux_layer_ids}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size: {self.draft_vocab_size} not in 1..vocab_size={self.vocab_size}")

    @classmethod
    def from_hf(cls, cfg: dict, num_target_layers: int | None = None) -> Eagle3Config:
        """From a published head's ``config.json``; aux layers from
        ``eagle_aux_hidden_state_layer_ids`` (or ``eagle_config``), else vLLM's default for
        ``num_target_layers``."""
        eagle = cfg.get("eagle_config") or {}
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            if num_target_layers is None:
                raise ValueError("config.json names no eagle_aux_hidden_state_layer_ids: pass the "
                                 "target's num_target_layers")
            aux = default_aux_layer_ids(num_target_layers)
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"num_hidden_layers: an EAGLE-3 head has 1 layer, got {cfg['num_hidden_layers']}")
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        known = {"hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "vocab_size", "draft_vocab_size", "rms_norm_eps",
                 "rope_theta", "max_position_embeddings", "norm_before_residual",
                 "eagle_aux_hidden_state_layer_ids"}
        return cls(hidden_size=hidden,
                   target_hidden_size=cfg.get("target_hidden_size") or hidden,
                   num_attention_heads=heads,
                   num_key_value_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or hidden // heads,
                   intermediate_size=cfg["intermediate_size"],
                   vocab_size=cfg["vocab_size"],
                   draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
                   aux_layer_ids=tuple(int(i) for i in aux),
                   rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
                   rope_theta=cfg.get("rope_theta", 10000.0),
                   max_position_embeddings=cfg.get("max_position_embeddings", 8192),
                   norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                   extra={k: v for k, v in cfg.items() if k not in known})

    def to_hf(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("aux_layer_ids", "extra")}
        d.update(self.extra)
        d.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                 hidden_act="silu", eagle_aux_hidden_state_layer_ids=list(self.aux_layer_ids),
                 eagle_config={"use_aux_hidden_state": True,
                               "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)})
        return d


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        d_in = 2 * c.hidden_size
        self.q_proj = nn.Linear(d_in, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(nn.Module):
    """Weights under the published names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
    ``t2d``); ``forward`` is one draft position for T rows at once."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self._rope: RotaryTable | None = None

    def rope(self) -> RotaryTable:
        w = self.fc.weight
        if self._rope is None or self._rope.cos.device != w.device or self._rope.cos.dtype != w.dtype:
            c = self.config
            self._rope = RotaryTable(c.head_dim, c.rope_theta, None, c.max_position_embeddings, w.dtype, w.device)
        return self._rope

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft vocabulary = ``target_ids`` (ascending, ``draft_vocab_size`` of them): fills
        ``d2t`` (target = draft + d2t[draft]) and ``t2d``."""
        ids = torch.as_tensor(target_ids, dtype=torch.int64).sort().values
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"target_ids: {ids.numel()} ids for draft_vocab_size={self.config.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux [T, 3 * H_target]`` (low, mid, high concatenated) -> ``h [T, H]``."""
        return self.fc(aux)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attend: Attend, out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft position: ``embeds [T, H]`` (target embedding of the input token), ``hidden
        [T, H]`` (``fuse`` of the target's states, or the previous step's output), ``positions
        [T]``. Returns (pre-norm output ``[T, H]``: the next step's ``hidden``; draft logits
        ``[T, V_draft]``), or both for the rows ``out_rows`` (indices) only.

        With ``out_rows`` every row's K/V still goes to ``attend``, and only those rows query.
        Exact because the head is one layer: a row's K/V depend on its own inputs alone, so a row
        whose output nobody reads needs no query, attention, MLP or logits. The engine's catch-up
        over a prompt reads the last row's output only: fc and k/v projections for the rest (1.4
        of a layer's 3.8 M multiply-adds per row, no attention)."""
        c, layer = self.config, self.midlayer
        h_normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds), h_normed], dim=-1)
        residual = h_normed if c.norm_before_residual else hidden
        attn = layer.self_attn
        k = attn.k_proj(x).view(x.shape[0], c.num_key_value_heads, c.head_dim)
        v = attn.v_proj(x).view(x.shape[0], c.num_key_value_heads, c.head_dim)
        rope = self.rope()
        cos, sin = rope.lookup(positions)
        k = rope.apply(k, cos, sin)
        if out_rows is not None:
            x, residual, cos, sin = x[out_rows], residual[out_rows], cos[out_rows], sin[out_rows]
        q = rope.apply(attn.q_proj(x).view(x.shape[0], c.num_attention_heads, c.head_dim), cos, sin)
        h = residual + attn.o_proj(attend(q, k, v))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, self.lm_head(self.norm(h))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention over one sequence (rows = positions in order), GQA expanded: the
    ``attend`` for training and for a head that drafts from a fresh prefix."""
    t, heads, d = q.shape
    rep = heads // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True)
    return out.transpose(0, 1).reshape(t, heads * d)


WEIGHTS = "model.safetensors"


def save_eagle3(head: Eagle3Head, path: str, dtype: torch.dtype = torch.float16) -> None:
    """``path/config.json`` + ``path/model.safetensors`` in the published layout (float weights
    in ``dtype``; ``d2t`` int64, ``t2d`` bool)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
               for k, v in head.state_dict().items()}
    save_file(tensors, os.path.join(path, WEIGHTS))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(head.config.to_hf(), f, indent=1)


def load_eagle3(path: str, *, num_target_layers: int | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """A published-layout head directory -> :class:`Eagle3Head` (eval mode). Reads every
    ``*.safetensors`` file there; ``embed_tokens.weight`` if present is ignored (the target's
    embedding is used); a missing ``d2t`` means the full vocabulary (identity map)."""
    from safetensors.torch import load_file
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"speculative_config.model: {path!r} has no config.json (an EAGLE-3 head directory)")
    with open(cfg_path) as f:
        config = Eagle3Config.from_hf(json.load(f), num_target_layers)
    state: dict[str, torch.Tensor] = {}
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"speculative_config.model: {path!r} has no .safetensors file")
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    state.pop("embed_tokens.weight", None)
    head = Eagle3Head(config)
    if "d2t" not in state:
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in state:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(config.draft_vocab_size) + state["d2t"]] = True
        state["t2d"] = t2d
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"speculative_config.model: {path!r} is not an EAGLE-3 head "
                         f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    return head.to(device=device, dtype=dtype).eval()


__all__ = ["Attend", "Eagle3Config", "Eagle3Head", "causal_attention", "default_aux_layer_ids",
           "load_eagle3", "save_eagle3"]
