"""The EAGLE-3 head on a quantized CPU target: its linears weight-only quantized
(``quantize_head``), and its forward in one C call (``Eagle3CpuForward``, ``tb_eagle3`` in
``kernels/cpu/eagle3_head.c``) where the C kernels run it. Both are applied around the plain head
of ``engine.model.eagle3``, which keeps its published layout and its torch forward (training, a
float target, torch's kernels).

Why a C forward: at batch 1 a draft step is one row through ~40 torch ops of a few microseconds
each (embedding lookup, norms, GEMMs, RoPE, attention, SiLU, lm head, argmax), run right after the
target's forward evicted the head from the caches: ~500 us a step cold against ~234 us warm, where
the call takes ~220 and ~68 (``benches/eagle3_head_step.py``); what is left is reading the weights. The
call computes what ``Eagle3Head.forward`` computes (with the embedding lookup before it, ``fuse``
for a catch-up, and the greedy draft after it), up to float rounding: its norms, SiLU and
attention sum in the C kernels' fixed order. Like ``forward(out_rows=...)``, only each segment's
last row queries: every row's K/V is written, one output per segment.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokenbudget.engine.model.cpu_forward import tb_linear
from tokenbudget.engine.model.eagle3 import Eagle3Head
from tokenbudget.engine.model.quant import Q8Embedding, QuantLinear
from tokenbudget.kernels.cpu.decoder_forward import TbLinear
from tokenbudget.kernels.cpu.eagle3_head import TbEagle3, tb_eagle3
from tokenbudget.kernels.cpu.native import library


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
    return tb_linear(quant)


class Eagle3CpuForward:
    """The head's forward as one ``tb_eagle3`` call (module doc), from token ids and tap states
    (or the previous draft step's outputs) to each segment's output, logits and greedy draft.
    Holds the C view of the head's weights and the target's embedding; they own them."""

    def __init__(self, head: Eagle3Head, embed, linears: dict[str, TbLinear]) -> None:
        self.head, self.embed = head, embed
        c, layer = head.config, head.midlayer
        self._keep = [n.weight.detach().contiguous() for n in
                      (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, head.norm)]
        self._d2t = head.d2t.to(torch.int64).contiguous()
        norms = [t.data_ptr() for t in self._keep]
        if isinstance(embed, torch.Tensor):
            tables = dict(embed_f32=embed.data_ptr())
        else:
            tables = dict(embed_codes=embed.codes.data_ptr(), embed_scales=embed.scales.data_ptr())
        # the fields every call shares; __call__ sets the rest
        self._args = TbEagle3(
            hidden=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, intermediate=c.intermediate_size, draft_vocab=c.draft_vocab_size,
            norm_before_residual=int(c.norm_before_residual), aux_width=3 * c.target_hidden_size,
            eps=c.rms_norm_eps, scale=c.head_dim ** -0.5, input_norm=norms[0], hidden_norm=norms[1],
            post_norm=norms[2], norm=norms[3], d2t=self._d2t.data_ptr(), **linears, **tables)

    @classmethod
    def build(cls, head: Eagle3Head, embed) -> Eagle3CpuForward | None:
        """The C forward of ``head`` over the target's ``embed`` (an fp32 ``[V, H]`` table or a
        ``quant.Q8Embedding``), or None where it cannot run: no C kernels, a head not fp32 on the
        CPU, a linear not on the C kernels (``quantize_head``), a head size the row ops do not take
        (hidden a multiple of 32; head_dim a multiple of 16, at most 256), another embedding."""
        c = head.config
        if library() is None or head.fc.weight.dtype != torch.float32 or head.fc.weight.device.type != "cpu":
            return None
        if c.hidden_size % 32 or c.head_dim % 16 or c.head_dim > 256:
            return None
        if isinstance(embed, torch.Tensor):
            if embed.dtype != torch.float32 or embed.device.type != "cpu" or not embed.is_contiguous():
                return None
        elif not isinstance(embed, Q8Embedding):
            return None
        if tuple(embed.shape) != (c.vocab_size, c.hidden_size):
            return None
        attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
        modules = {"fc": head.fc, "q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj,
                   "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj, "lm_head": head.lm_head}
        linears = {name: _native(m) for name, m in modules.items()}
        if any(lin is None for lin in linears.values()):
            return None
        return cls(head, embed, linears)

    def __call__(self, token_ids: Sequence[int], states: torch.Tensor, positions: Sequence[int],
                 segments: Sequence[tuple[torch.Tensor, int, int]], fuse: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Rows ``r < T``: the input token ``token_ids[r]`` at ``positions[r]``, and ``states[r]``:
        the target's tap states ``[3 * H_target]`` (``fuse``: ``fc`` applies) or the hidden state
        ``[H]``. ``segments[s] = (kv, at, n)``: the next ``n`` rows are one request's, their K/V go
        to rows ``[at, at + n)`` of ``kv [2, cap, Hk, D]`` (K then V, fp32, contiguous) after the
        ``at`` rows there. -> (pre-norm output ``[S, H]``, draft logits ``[S, V_draft]``, greedy
        draft as a target id) of each segment's last row."""
        c = self.head.config
        t, ns = len(token_ids), len(segments)
        width = 3 * c.target_hidden_size if fuse else c.hidden_size
        if (t == 0 or len(positions) != t or sum(n for _, _, n in segments) != t
                or states.shape != (t, width) or states.dtype != torch.float32 or not states.is_contiguous()):
            raise ValueError(f"{t} token ids, {len(positions)} positions, states {tuple(states.shape)} "
                             f"{states.dtype} (want [T, {width}] float32), segments of "
                             f"{sum(n for _, _, n in segments)} rows")
        rope = self.head.rope()
        if min(positions) < 0 or max(positions) >= rope.max_pos:
            raise IndexError(f"positions must be in [0, {rope.max_pos}), got [{min(positions)}, {max(positions)}]")
        if min(token_ids) < 0 or max(token_ids) >= c.vocab_size:
            raise IndexError(f"token ids must be in [0, {c.vocab_size}), got [{min(token_ids)}, {max(token_ids)}]")
        kv_shape = (2, c.num_key_value_heads, c.head_dim)
        for kv, at, n in segments:
            if (kv.dtype != torch.float32 or not kv.is_contiguous() or (kv.shape[0], *kv.shape[2:]) != kv_shape
                    or at < 0 or n < 1 or at + n > kv.shape[1]):
                raise ValueError(f"segment ({at}, {n}) does not fit its K/V buffer {tuple(kv.shape)} {kv.dtype}")
        ints = torch.tensor([*token_ids, *positions, *(kv.data_ptr() for kv, _, _ in segments),
                             *(kv.shape[1] for kv, _, _ in segments), *(at for _, at, _ in segments),
                             *(n for _, _, n in segments)], dtype=torch.int64)
        base = ints.data_ptr()
        h_out = torch.empty(ns, c.hidden_size)
        logits = torch.empty(ns, c.draft_vocab_size)
        greedy = torch.empty(ns, dtype=torch.int64)
        a = self._args
        a.num_rows, a.num_segments, a.num_threads = t, ns, torch.get_num_threads()
        a.token_ids, a.positions = base, base + 8 * t
        a.seg_kv, a.seg_cap, a.seg_at, a.seg_rows = (base + 8 * (2 * t + i * ns) for i in range(4))
        a.aux, a.hidden_in = (states.data_ptr(), 0) if fuse else (0, states.data_ptr())
        a.cos, a.sin = rope.cos.data_ptr(), rope.sin.data_ptr()
        a.h_out, a.logits, a.greedy = h_out.data_ptr(), logits.data_ptr(), greedy.data_ptr()
        tb_eagle3(a)
        return h_out, logits, greedy.tolist()


__all__ = ["Eagle3CpuForward", "QuantLinearModule", "quantize_head"]
