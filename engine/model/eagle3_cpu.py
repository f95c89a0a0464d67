"""The EAGLE-3 head on a quantized CPU target: its linears weight-only quantized
(``quantize_head``), and its forward in one C call (``Eagle3CpuForward``, ``tb_eagle3`` in
``kernels/cpu/eagle3_head.c``) where the C kernels run it. Both are applied around the plain head
of ``engine.model.eagle3``, which keeps its published layout and its torch forward (training, a
float target, torch's kernels).

Why a C forward: at batch 1 a draft step is one row through ~40 torch ops of a few microseconds
each, run right after the target's forward evicted the head from the caches (~450 us a step in
the engine, against ~220 us in a warm loop: benches/RESULTS.md); the C call leaves the weight
reads. It computes what ``Eagle3Head.forward`` computes, up to float rounding (its norms, SiLU and
attention sum in the C kernels' fixed order), and, like ``forward(out_rows=...)``, only each
segment's last row queries: every row's K/V is written, one output per segment.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenbudget.engine.model.eagle3 import Eagle3Head
from tokenbudget.engine.model.quant import QuantLinear
from tokenbudget.kernels.cpu.decoder_forward import TbLinear
from tokenbudget.kernels.cpu.eagle3_head import TbEagle3, tb_eagle3
from tokenbudget.kernels.cpu.native import library

_FMT = {"int4": 4, "int8": 8}


class QuantLinearModule(nn.Module):
    """A ``QuantLinear`` where the head holds an ``nn.Linear``; ``weight`` is an empty tensor that
    only says the activations' dtype and device (``Eagle3Head.rope``)."""

    def __init__(self, linear: nn.Linear, mode: str) -> None:
        super().__init__()
        self.quant = QuantLinear.from_float(linear.weight.data, mode)
        self.register_buffer("weight", torch.empty(0, dtype=linear.weight.dtype, device=linear.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant(x.contiguous())


def quantize_head(head: Eagle3Head, mode: str, lm_head_mode: str | None = None) -> None:
    """Every linear of ``head`` weight-only quantized in ``mode``, the draft lm head too (or in
    ``lm_head_mode``), in place.

    Unlike the target's lm head (int8 in both modes, ``quant.LM_HEAD_MODE``), the draft lm head
    follows ``mode``: it is more than half of the bytes a draft step reads (4096 x 576 for the
    shipped head: 2.36 MB int8, 1.47 MB int4, the rest of the layer 1.7 MB in int4), a draft step at
    batch 1 costs about its bytes read from memory, and int4 left the shipped head's held-out τ
    where it was (2.113 int8, 2.111 int4; benches/eagle3_lm_head.py, benches/RESULTS.md)."""
    layer = head.midlayer
    head.fc = QuantLinearModule(head.fc, mode)
    for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                         (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            setattr(owner, name, QuantLinearModule(getattr(owner, name), mode))
    head.lm_head = QuantLinearModule(head.lm_head, lm_head_mode or mode)


def _native(module) -> TbLinear | None:
    """The C kernels' view of a quantized linear, or None where it does not run on them."""
    quant = getattr(module, "quant", None)
    w = getattr(quant, "native", None)
    if w is None or quant.bias is not None:
        return None
    scales = getattr(w, "s", None)
    return TbLinear(_FMT[quant.mode], w.packed.data_ptr(), 0 if scales is None else scales.data_ptr(), 0)


class Eagle3CpuForward:
    """The head's forward as one ``tb_eagle3`` call (module doc). Holds the C view of the head's
    weights; the head owns them."""

    def __init__(self, head: Eagle3Head, linears: dict[str, TbLinear]) -> None:
        self.head = head
        c, layer = head.config, head.midlayer
        self._norms = [n.weight.detach().contiguous() for n in
                       (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, head.norm)]
        self._linears = linears
        self._scale = c.head_dim ** -0.5

    @classmethod
    def build(cls, head: Eagle3Head) -> Eagle3CpuForward | None:
        """The C forward of ``head``, or None where it cannot run: no C kernels, a head not fp32 on
        the CPU, a linear not on the C kernels (``quantize_head``), a head size the row ops do not
        take (hidden a multiple of 16; head_dim a multiple of 16, at most 256)."""
        c = head.config
        if library() is None or head.fc.weight.dtype != torch.float32 or head.fc.weight.device.type != "cpu":
            return None
        if c.hidden_size % 16 or c.head_dim % 16 or c.head_dim > 256:
            return None
        attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
        modules = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj, "gate": mlp.gate_proj,
                   "up": mlp.up_proj, "down": mlp.down_proj, "lm_head": head.lm_head}
        linears = {name: _native(m) for name, m in modules.items()}
        if any(lin is None for lin in linears.values()):
            return None
        return cls(head, linears)

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 segments: list[tuple[torch.Tensor, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``embeds``, ``hidden`` ``[T, H]``, ``positions [T]``; ``segments[s] = (kv, at, n)``: the next
        ``n`` rows are one request's, their K/V go to rows ``[at, at + n)`` of ``kv [2, cap, Hk, D]``
        (K then V, fp32, contiguous) after the ``at`` rows there. -> (pre-norm output ``[S, H]``,
        draft logits ``[S, V_draft]``) of each segment's last row."""
        c, head = self.head.config, self.head
        t, ns = embeds.shape[0], len(segments)
        if sum(n for _, _, n in segments) != t or hidden.shape[0] != t or positions.shape[0] != t or t == 0:
            raise ValueError(f"segments cover {sum(n for _, _, n in segments)} rows of {t} (hidden "
                             f"{hidden.shape[0]}, positions {positions.shape[0]})")
        rope = head.rope()
        lo, hi = torch.aminmax(positions)
        if lo < 0 or hi >= rope.max_pos:
            raise IndexError(f"positions must be in [0, {rope.max_pos}), got [{int(lo)}, {int(hi)}]")
        kv_shape = (2, c.num_key_value_heads, c.head_dim)
        for kv, at, n in segments:
            if (kv.dtype != torch.float32 or not kv.is_contiguous() or (kv.shape[0], *kv.shape[2:]) != kv_shape
                    or at < 0 or n < 1 or at + n > kv.shape[1]):
                raise ValueError(f"segment ({at}, {n}) does not fit its K/V buffer {tuple(kv.shape)} {kv.dtype}")
        embeds = embeds.to(torch.float32).contiguous()
        hidden = hidden.to(torch.float32).contiguous()
        pos = positions.to(torch.int64).contiguous()
        seg = torch.tensor([[kv.data_ptr(), kv.shape[1], at, n] for kv, at, n in segments], dtype=torch.int64)
        seg = seg.T.contiguous()  # rows: buffer addresses, capacities, at, n
        h_out = torch.empty(ns, c.hidden_size)
        logits = torch.empty(ns, c.draft_vocab_size)
        lin = self._linears
        tb_eagle3(TbEagle3(
            num_rows=t, num_segments=ns, hidden=c.hidden_size, num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
            draft_vocab=c.draft_vocab_size, num_threads=torch.get_num_threads(),
            norm_before_residual=int(c.norm_before_residual), eps=c.rms_norm_eps, scale=self._scale,
            input_norm=self._norms[0].data_ptr(), hidden_norm=self._norms[1].data_ptr(),
            post_norm=self._norms[2].data_ptr(), norm=self._norms[3].data_ptr(),
            q=lin["q"], k=lin["k"], v=lin["v"], o=lin["o"], gate=lin["gate"], up=lin["up"], down=lin["down"],
            lm_head=lin["lm_head"], embeds=embeds.data_ptr(), hidden_in=hidden.data_ptr(), positions=pos.data_ptr(),
            cos=rope.cos.data_ptr(), sin=rope.sin.data_ptr(), seg_kv=seg[0].data_ptr(), seg_cap=seg[1].data_ptr(),
            seg_at=seg[2].data_ptr(), seg_rows=seg[3].data_ptr(), h_out=h_out.data_ptr(), logits=logits.data_ptr()))
        return h_out, logits


__all__ = ["Eagle3CpuForward", "QuantLinearModule", "quantize_head"]
