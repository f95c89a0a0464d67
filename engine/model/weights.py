"""A Hugging Face state dict -> the decoder's per-layer weights, for every family the config
describes.

The names are HF's (``model.layers.{i}.self_attn.q_proj.weight`` ...), whatever the file format:
the GGUF loader renames llama.cpp's tensors to them. What differs between families is read from
the config, never guessed from the family's name:

* q/k/v are fused into one ``[(H + 2 Hk) D, hidden]`` weight and gate/up into one ``[2 I, hidden]``
  (a checkpoint may already store them fused: Phi-3's ``qkv_proj`` / ``gate_up_proj``);
* the norms are named by their role in the layer (``LayerWeights``); which HF tensor fills which
  role is the config's ``norm_layout`` (Llama's ``post_attention_layernorm`` is the MLP's input
  norm, Gemma's and OLMo 2's normalises the attention's output);
* Gemma's ``(1 + w)`` RMSNorm scale is folded into the weight here (``norm_weight_offset``): the
  same fp32 product transformers computes;
* biases are read where the checkpoint has them and required where the config says so.

Every tensor of the state dict must be used: a leftover one (say a Gemma norm in a file
labelled Llama) is a ValueError naming it, as is a missing tensor or a shape that does not match
the config (``expected_shapes`` is the table both checks read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.layers import Linear
from tokenbudget.engine.model.moe import MoEWeights
from tokenbudget.engine.model.rope import RotaryTable

# role -> the HF norm that fills it, per norm_layout (None: the layout has no such norm)
_NORM_ROLES = {
    "pre": {"attn_in_norm": "input_layernorm", "mlp_in_norm": "post_attention_layernorm"},
    "sandwich": {"attn_in_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                 "mlp_in_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
    "post": {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some checkpoints save; recomputed here


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer. A norm that the family does not have is None."""

    qkv: Linear                  # [(H + 2 Hk) * D, hidden] (+ bias)
    o: Linear                    # [hidden, H * D]
    gate_up: Linear | None = None  # [2 I, hidden]; None in an MoE layer
    down: Linear | None = None     # [hidden, I]
    moe: MoEWeights | None = None  # an MoE layer's router and experts
    sinks: torch.Tensor | None = None  # [H] fp32 attention-sink logits (gpt-oss)
    attn_in_norm: torch.Tensor | None = None   # on the attention's input (pre, sandwich)
    attn_out_norm: torch.Tensor | None = None  # on the attention's output (sandwich, post)
    mlp_in_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D] (qk_norm "head") or [H * D] ("proj")
    k_norm: torch.Tensor | None = None  # [D] or [Hk * D]
    window: int = 0              # sliding window (0: the whole context)
    rope: RotaryTable | None = None  # None: a layer without RoPE

    def map_linears(self, fn) -> None:
        """Replace every GEMM's ``Linear`` by ``fn(linear)`` (quantization, deterministic mode,
        training), the experts' included; MoE routers stay as they are: their top-k choice is
        what the model is, so they keep the checkpoint's float weights."""
        self.qkv, self.o = fn(self.qkv), fn(self.o)
        if self.gate_up is not None:
            self.gate_up, self.down = fn(self.gate_up), fn(self.down)
        if (m := self.moe) is not None:
            m.gate_up, m.down = [fn(x) for x in m.gate_up], [fn(x) for x in m.down]
            if m.shared_gate_up is not None:
                m.shared_gate_up, m.shared_down = fn(m.shared_gate_up), fn(m.shared_down)


def expected_shapes(config: ModelConfig, names) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads from a checkpoint whose tensor names are ``names`` (the fused
    or split projections, optional biases and ``lm_head`` follow what is there), with its shape."""
    c, d = config, config.resolved_head_dim
    h, hk, hid, inter = c.num_attention_heads, c.num_key_value_heads, c.hidden_size, c.intermediate_size
    out = {"model.embed_tokens.weight": (c.vocab_size, hid), "model.norm.weight": (hid,)}
    if not c.tie_word_embeddings or "lm_head.weight" in names:
        out["lm_head.weight"] = (c.vocab_size, hid)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        proj = {"q": h * d, "k": hk * d, "v": hk * d}
        fused_qkv = p + "self_attn.qkv_proj.weight" in names
        for n, rows in ({"qkv": sum(proj.values())} if fused_qkv else proj).items():
            out[f"{p}self_attn.{n}_proj.weight"] = (rows, hid)
            if c.attention_bias or f"{p}self_attn.{n}_proj.bias" in names:
                out[f"{p}self_attn.{n}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (hid, h * d)
        if c.o_proj_bias or p + "self_attn.o_proj.bias" in names:
            out[p + "self_attn.o_proj.bias"] = (hid,)
        if c.is_moe_layer(i):
            out.update(_moe_shapes(c, p, names))
        else:
            out.update(_mlp_shapes(c, p + "mlp.", names, inter))
        if c.attention_sinks:
            out[p + "self_attn.sinks"] = (h,)
        for hf in _NORM_ROLES[c.norm_layout].values():
            out[f"{p}{hf}.weight"] = (hid,)
        if c.qk_norm != "none":
            out[p + "self_attn.q_norm.weight"] = (d,) if c.qk_norm == "head" else (h * d,)
            out[p + "self_attn.k_norm.weight"] = (d,) if c.qk_norm == "head" else (hk * d,)
    return out


def _mlp_shapes(c: ModelConfig, m: str, names, inter: int) -> dict[str, tuple[int, ...]]:
    """A gated MLP under prefix ``m``: fused ``gate_up_proj`` or ``gate_proj`` + ``up_proj``, ``down_proj``."""
    hid, out = c.hidden_size, {}
    parts = {"gate_up": 2 * inter} if m + "gate_up_proj.weight" in names else {"gate": inter, "up": inter}
    for n, rows in parts.items():
        out[f"{m}{n}_proj.weight"] = (rows, hid)
        if c.mlp_bias or f"{m}{n}_proj.bias" in names:
            out[f"{m}{n}_proj.bias"] = (rows,)
    out[m + "down_proj.weight"] = (hid, inter)
    if c.mlp_bias or m + "down_proj.bias" in names:
        out[m + "down_proj.bias"] = (hid,)
    return out


def moe_layout(config: ModelConfig, prefix: str, names) -> str:
    """How a checkpoint stores layer ``prefix``'s experts: ``mixtral`` (``block_sparse_moe.experts.
    {e}.w1/w2/w3``), ``stacked`` (gpt-oss: ``mlp.experts.gate_up_proj [E, hidden, 2 I]`` with gate
    and up interleaved, ``down_proj [E, I, hidden]``, biases), or ``per_expert`` (Qwen-MoE:
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``)."""
    if prefix + "block_sparse_moe.gate.weight" in names:
        return "mixtral"
    if prefix + "mlp.experts.gate_up_proj" in names:
        return "stacked"
    return "per_expert"


def _moe_shapes(c: ModelConfig, p: str, names) -> dict[str, tuple[int, ...]]:
    e, hid, inter = c.num_experts, c.hidden_size, c.expert_intermediate_size
    layout = moe_layout(c, p, names)
    if layout == "mixtral":
        out = {p + "block_sparse_moe.gate.weight": (e, hid)}
        for x in range(e):
            q = f"{p}block_sparse_moe.experts.{x}."
            out.update({q + "w1.weight": (inter, hid), q + "w3.weight": (inter, hid), q + "w2.weight": (hid, inter)})
        return out
    router = p + ("mlp.router." if p + "mlp.router.weight" in names else "mlp.gate.")
    out = {router + "weight": (e, hid)}
    if router + "bias" in names:
        out[router + "bias"] = (e,)
    if layout == "stacked":
        x = p + "mlp.experts."
        out.update({x + "gate_up_proj": (e, hid, 2 * inter), x + "down_proj": (e, inter, hid)})
        out.update({x + "gate_up_proj_bias": (e, 2 * inter), x + "down_proj_bias": (e, hid)})
        return out
    for x in range(e):
        out.update(_mlp_shapes(c, f"{p}mlp.experts.{x}.", names, inter))
    if c.shared_expert_intermediate_size:
        out.update(_mlp_shapes(c, p + "mlp.shared_expert.", names, c.shared_expert_intermediate_size))
        out[p + "mlp.shared_expert_gate.weight"] = (1, hid)
    return out


def check_state_dict(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming the tensor when one is missing, unexpected, or of a shape the config does
    not give it. ``shapes``: name -> shape of every tensor of the checkpoint (a loader can take
    them from the file's headers, before reading any data)."""
    want = _check_names(config, shapes)
    for name, shape in want.items():
        _check_shape(name, tuple(shapes[name]), shape)


def _check_names(config: ModelConfig, names) -> dict[str, tuple[int, ...]]:
    want = expected_shapes(config, names)
    missing = [n for n in want if n not in names]
    if missing:
        raise ValueError(f"the checkpoint is missing {missing[0]} (architecture {config.architecture!r})")
    extra = sorted(n for n in names if n not in want and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"unexpected tensor {extra[0]} for architecture {config.architecture!r} "
                         f"({len(extra)} unused tensors): the config does not describe this checkpoint")
    return want


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ValueError(f"{name} has shape {got}, the config gives {want} (hidden_size, num_attention_heads, "
                         "num_key_value_heads, head_dim, intermediate_size, vocab_size)")


class WeightReader:
    """Takes tensors out of a state dict in the model's dtype/device. Names are checked first (no
    tensor is touched: a state dict may make its tensors on access), each shape as it is read."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype, device):
        self.names = set(state_dict.keys())
        self.want = _check_names(config, self.names)
        self.config, self.sd, self.dtype, self.device = config, state_dict, dtype, device

    def _take(self, name: str) -> torch.Tensor:
        t = self.sd[name]
        _check_shape(name, tuple(t.shape), self.want[name])
        return t

    def get(self, name: str) -> torch.Tensor:
        return self._take(name).to(dtype=self.dtype, device=self.device).contiguous()

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self.names else None

    def norm(self, name: str) -> torch.Tensor:
        """An RMSNorm scale with the family's offset folded in (computed in fp32, as transformers
        does, then cast)."""
        w = self._take(name)
        if self.config.norm_weight_offset:
            w = w.float() + self.config.norm_weight_offset
        return w.to(dtype=self.dtype, device=self.device).contiguous()

    def fused(self, prefix: str, fused: str, parts: tuple[str, ...], suffix: str) -> torch.Tensor | None:
        """``prefix{fused}{suffix}`` if the checkpoint stores it fused, else the parts concatenated
        (None when the parts are absent: an optional bias)."""
        if prefix + fused + suffix in self.names:
            return self.get(prefix + fused + suffix)
        if prefix + parts[0] + suffix not in self.names:
            return None
        return torch.cat([self.get(prefix + n + suffix) for n in parts])

    def mlp(self, m: str) -> tuple[Linear, Linear]:
        """The gated MLP under prefix ``m``: (fused gate/up, down)."""
        gate_up = (m, "gate_up_proj", ("gate_proj", "up_proj"))
        return (Linear(self.fused(*gate_up, ".weight"), self.fused(*gate_up, ".bias")),
                Linear(self.get(m + "down_proj.weight"), self.maybe(m + "down_proj.bias")))

    def moe(self, p: str) -> MoEWeights:
        c = self.config
        layout = moe_layout(c, p, self.names)
        if layout == "mixtral":
            q = p + "block_sparse_moe."
            router = Linear(self.get(q + "gate.weight"))
            gate_up = [Linear(torch.cat([self.get(f"{q}experts.{e}.w1.weight"), self.get(f"{q}experts.{e}.w3.weight")]))
                       for e in range(c.num_experts)]
            down = [Linear(self.get(f"{q}experts.{e}.w2.weight")) for e in range(c.num_experts)]
            return MoEWeights(router, gate_up, down)
        r = p + ("mlp.router." if p + "mlp.router.weight" in self.names else "mlp.gate.")
        router = Linear(self.get(r + "weight"), self.maybe(r + "bias"))
        if layout == "stacked":  # gpt-oss: input-major, gate and up interleaved (columns 0::2, 1::2)
            x = p + "mlp.experts."
            gu, gub = self.get(x + "gate_up_proj"), self.get(x + "gate_up_proj_bias")
            dn, dnb = self.get(x + "down_proj"), self.get(x + "down_proj_bias")
            gate_up = [Linear(torch.cat([gu[e, :, 0::2].t(), gu[e, :, 1::2].t()]).contiguous(),
                              torch.cat([gub[e, 0::2], gub[e, 1::2]]).contiguous()) for e in range(c.num_experts)]
            down = [Linear(dn[e].t().contiguous(), dnb[e].contiguous()) for e in range(c.num_experts)]
            return MoEWeights(router, gate_up, down)
        experts = [self.mlp(f"{p}mlp.experts.{e}.") for e in range(c.num_experts)]
        shared = self.mlp(p + "mlp.shared_expert.") if c.shared_expert_intermediate_size else (None, None)
        gate = Linear(self.get(p + "mlp.shared_expert_gate.weight")) if c.shared_expert_intermediate_size else None
        return MoEWeights(router, [g for g, _ in experts], [d for _, d in experts], *shared, gate)

    def layer(self, i: int, window: int, rope: RotaryTable) -> LayerWeights:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = (a, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        norms = {role: self.norm(f"{p}{hf}.weight") for role, hf in _NORM_ROLES[self.config.norm_layout].items()}
        moe = self.moe(p) if self.config.is_moe_layer(i) else None
        gate_up, down = self.mlp(p + "mlp.") if moe is None else (None, None)
        return LayerWeights(
            qkv=Linear(self.fused(*qkv, ".weight"), self.fused(*qkv, ".bias")),
            o=Linear(self.get(a + "o_proj.weight"), self.maybe(a + "o_proj.bias")),
            gate_up=gate_up, down=down, moe=moe,
            sinks=self._take(a + "sinks").float().to(self.device) if self.config.attention_sinks else None,
            q_norm=self.norm(a + "q_norm.weight") if self.config.qk_norm != "none" else None,
            k_norm=self.norm(a + "k_norm.weight") if self.config.qk_norm != "none" else None,
            window=window, rope=rope, **norms)
