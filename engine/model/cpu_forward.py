"""The whole decoder forward in one C call (``tb_forward`` in ``kernels/cpu/decoder_forward.c``),
installed around a quantized model on the CPU (``CpuForwardModel``), as the CUDA graph runner is
installed around a model on a GPU: the model code itself has no branch for it.

Why: with the weight-only GEMMs at memory speed, what was left of a batch-1 decode step on the CPU
was ~100 small torch ops per layer (norms, RoPE, the KV write, attention, casts, residual adds),
each a few microseconds of dispatch. One call per step runs all layers instead; torch keeps the
embedding lookup, the final norm and everything around the forward.

Same contract as ``DecoderLM.forward``: a flat batch of requests in any mix of prefill
chunks, decodes and verifies, K/V written through ``slot_mapping`` into the same paged cache
tensors ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (fp32), so the torch reference
backend and this path read each other's cache. Batch invariance holds by construction (the C
file's notes): every row is computed from itself and its own context, in an order fixed by the row.

Installed when ``CpuForward.build`` accepts the model: every linear on the C kernels, head_dim a
multiple of 16 and at most 256; a step whose KV cache is not fp32 on the CPU runs the torch forward.
"""

from __future__ import annotations

import torch

from tokenbudget.engine.model.layers import rms_norm
from tokenbudget.kernels.attention.base import AttentionMetadata
from tokenbudget.kernels.cpu import native
from tokenbudget.kernels.cpu.decoder_forward import TbForward, TbLayer, TbLinear, tb_forward
from tokenbudget.kernels.cpu.native import library

_FMT = {"int4": 4, "int8": 8}


def tb_linear(lin) -> TbLinear:
    """The C kernels' view of a ``QuantLinear`` on them (``lin.native`` set): format, weights, scales, bias."""
    w = lin.native
    scales = getattr(w, "s", None)
    return TbLinear(_FMT[lin.mode], w.packed.data_ptr(), 0 if scales is None else scales.data_ptr(),
                    0 if lin.bias is None else lin.bias.data_ptr())


def c_forward_name(model) -> str:
    """``the C decoder forward (avx2)`` where ``model`` runs one, else "" (the attention log line)."""
    if getattr(model, "cpu_forward", None) is None:
        return ""
    return f"the C decoder forward ({native.selected_variant()})"


def kernels_summary(model) -> str:
    """What runs the model's layers on the CPU, for the start-up line: the C kernel variant and
    whether the whole decoder forward is C, or torch's kernels and why."""
    if getattr(model, "cpu_forward", None) is not None:
        return f"C {native.selected_variant()} (GEMMs and the decoder forward)"
    if getattr(model, "quantization", "none") == "none":
        return "torch"
    lm_head = getattr(model, "lm_head", None)
    if getattr(lm_head, "native", None) is not None:
        missing = unsupported_switches(model.config)
        why = f" (the C forward does not run: {', '.join(missing)})" if missing else ""
        return f"C {native.selected_variant()} GEMMs, torch forward{why}"
    return f"torch's quantized kernels ({native.unavailable_reason() or 'shapes the C kernels do not take'})"


def unsupported_switches(config) -> list[str]:
    """The config switches (``engine/model/config.py``) the C forward does not run: a model that
    sets one runs the torch forward over the same C GEMMs (said in the start-up line). The C forward
    runs q/k norms, every norm layout, partial rotary, NoPE layers, per-layer RoPE tables, the
    attention scale, the residual multiplier, per-layer sliding windows, the attention logit
    soft-cap and SiLU or GELU-tanh gates; the embedding multiplier and the logits' scaling and
    soft-cap are torch's, around it."""
    c, out = config, []
    if c.hidden_act not in ("silu", "gelu_pytorch_tanh"):
        out.append(c.hidden_act)
    if c.num_experts:
        out.append("experts")
    if c.attention_sinks:
        out.append("attention sinks")
    return out


class CpuForwardModel:
    """``model`` with its decoder run by ``cpu_forward`` wherever the step's KV caches allow (fp32,
    on the CPU, contiguous); otherwise, or with ``cpu_forward`` set to None, the model's own torch
    forward. Everything else (``compute_logits``, config, weights) is the model's."""

    def __init__(self, model, cpu_forward: CpuForward) -> None:
        self.model = model
        self.cpu_forward: CpuForward | None = cpu_forward

    @classmethod
    def around(cls, model):
        """``model`` wrapped where the C forward can run it (``CpuForward.build``), else ``model``."""
        forward = CpuForward.build(model)
        return model if forward is None else cls(model, forward)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                 kv_caches: list[torch.Tensor], aux_layers: tuple[int, ...] | None = None):
        """The model's forward contract, taps included (``(hidden, aux)`` with ``aux_layers``,
        ``engine/model/aux_states.py``), whichever path runs."""
        m = self.model
        if self.cpu_forward is not None and self.cpu_forward.accepts(kv_caches):
            x, aux = self.cpu_forward(input_ids, positions, attn_metadata, kv_caches, aux_layers)
            hidden = rms_norm(x, m.norm, m.eps)
            return (hidden, aux) if aux_layers else hidden
        return m(input_ids, positions, attn_metadata, kv_caches, aux_layers=aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


class CpuForward:
    """Holds the per-layer ``TbLayer`` array (the model's tensors stay owned by the model)."""

    __slots__ = ("_aux_key", "_aux_tensor", "_linears", "_norms", "_table", "_table_key", "model")

    def __init__(self, model):
        self.model = model
        self._norms = [tuple(None if n is None else n.contiguous() for n in
                             (lw.attn_in_norm, lw.attn_out_norm, lw.mlp_in_norm, lw.mlp_out_norm, lw.q_norm, lw.k_norm))
                       for lw in model.layers]
        self._linears = [tuple(tb_linear(lin) for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)) for lw in model.layers]
        self._table, self._table_key = None, None
        self._aux_tensor, self._aux_key = None, None

    @classmethod
    def build(cls, model) -> CpuForward | None:
        """A ``CpuForward`` for ``model``, or None where the C forward cannot run it (module doc)."""
        if library() is None or model.dtype != torch.float32 or model.device.type != "cpu":
            return None
        if model.head_dim % 16 or model.head_dim > 256:  # hidden/intermediate: the native linears' K % 32
            return None
        if unsupported_switches(model.config):
            return None
        for lw in model.layers:
            for lin in (lw.qkv, lw.o, lw.gate_up, lw.down):
                if getattr(lin, "native", None) is None:  # a QuantLinear on the C kernels (quant.py)
                    return None
        return cls(model)

    def accepts(self, kv_caches: list[torch.Tensor]) -> bool:
        kv = kv_caches[0]
        return kv.dtype == torch.float32 and kv.device.type == "cpu" and all(c.is_contiguous() for c in kv_caches)

    def _layer_table(self, kv_caches: list[torch.Tensor]):
        """The ``TbLayer`` array for these caches (rebuilt only when they change)."""
        ropes = [lw.rope for lw in self.model.layers]
        key = (tuple(kv.data_ptr() for kv in kv_caches), tuple(0 if r is None else r.cos.data_ptr() for r in ropes))
        if key != self._table_key:  # the KV caches or a RoPE table (grown by reserve) moved
            if len(kv_caches) != len(self._norms):
                raise ValueError(f"{len(kv_caches)} KV caches for {len(self._norms)} layers")

            def ptr(t) -> int:
                return 0 if t is None else t.data_ptr()
            self._table = (TbLayer * len(kv_caches))(*[
                TbLayer(*map(ptr, norms), ptr(None if r is None else r.cos), ptr(None if r is None else r.sin),
                        kv.data_ptr(), *lins, lw.window)
                for norms, r, kv, lins, lw in zip(self._norms, ropes, kv_caches, self._linears, self.model.layers)])
            self._table_key = key
        return self._table

    def _aux_ids(self, aux_layers: tuple[int, ...]) -> torch.Tensor:
        """The tap ids as the int64 array the C side reads (rebuilt only when they change)."""
        if self._aux_key != aux_layers:
            self._aux_tensor, self._aux_key = torch.tensor(aux_layers, dtype=torch.int64), aux_layers
        return self._aux_tensor

    def _check_bounds(self, pos: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, kv: torch.Tensor) -> None:
        """The C code indexes raw memory: an out-of-range position, slot or block must raise here
        (as torch's indexing would on the torch path) instead of reading or writing past a buffer."""
        num_blocks, block_size = kv.shape[0], kv.shape[2]
        p_lo, p_hi = torch.aminmax(pos)
        s_lo, s_hi = torch.aminmax(slots)
        b_lo, b_hi = torch.aminmax(tables)
        max_pos = min(r.max_pos for r in self.model.ropes.values()) if self.model.ropes else 2**62
        if p_lo < 0 or p_hi >= max_pos:
            raise IndexError(f"positions must be in [0, {max_pos}), got [{int(p_lo)}, {int(p_hi)}]")
        if s_lo < 0 or s_hi >= num_blocks * block_size or b_lo < 0 or b_hi >= num_blocks:
            raise IndexError(f"KV slots [{int(s_lo)}, {int(s_hi)}] / blocks [{int(b_lo)}, {int(b_hi)}] "
                             f"outside the cache ({num_blocks} blocks of {block_size})")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                 kv_caches: list[torch.Tensor], aux_layers: tuple[int, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (the last layer's residual stream ``[T, hidden]``, the caller applies the final norm;
        the residual stream at the input of each layer in ``aux_layers``, ``[T, len * hidden]``,
        or None without taps)."""
        m, c = self.model, self.model.config
        t = md.num_tokens
        x = m.embed_tokens(input_ids[:t]).contiguous()
        qo, kv_lens = md.qo_indptr, md.kv_lens
        if len(kv_lens) == 1:  # the common decode / single-request shape, without tensor ops
            req = torch.zeros(t, dtype=torch.int32)
            ctx = torch.arange(kv_lens[0] - t + 1, kv_lens[0] + 1, dtype=torch.int32)
        else:
            q_lens = torch.tensor([qo[b + 1] - qo[b] for b in range(len(kv_lens))])
            req = torch.repeat_interleave(torch.arange(len(kv_lens), dtype=torch.int32), q_lens)
            first_ctx = torch.tensor(kv_lens) - q_lens + 1 - torch.tensor(qo[:-1])
            ctx = (first_ctx.repeat_interleave(q_lens) + torch.arange(t)).to(torch.int32)
        max_blocks = max(len(bt) for bt in md.block_tables)
        tables = torch.tensor([bt + [0] * (max_blocks - len(bt)) for bt in md.block_tables], dtype=torch.int32)
        layers = self._layer_table(kv_caches)
        pos = positions[:t].contiguous()
        slots = md.slot_mapping[:t].contiguous()
        self._check_bounds(pos, slots, tables, kv_caches[0])
        num_aux = len(aux_layers) if aux_layers else 0
        hsz = m.config.hidden_size
        aux = torch.empty(t, num_aux * hsz) if num_aux else None
        aux_ids = self._aux_ids(aux_layers) if num_aux else None
        tb_forward(TbForward(
            num_tokens=t, hidden=hsz, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim, intermediate=m.config.intermediate_size, num_layers=len(layers),
            block_size=kv_caches[0].shape[2], max_blocks=max_blocks, num_threads=torch.get_num_threads(),
            qk_norm={"none": 0, "head": 1, "proj": 2}[c.qk_norm], rotary_dim=c.rotary_dim,
            gelu=int(c.hidden_act == "gelu_pytorch_tanh"), eps=m.eps, scale=c.attention_scale or m.head_dim ** -0.5,
            residual_mult=c.residual_multiplier, softcap=c.attn_logit_softcapping or 0.0,
            layers=layers, x=x.data_ptr(), positions=pos.data_ptr(), slots=slots.data_ptr(), row_ctx=ctx.data_ptr(),
            row_req=req.data_ptr(), block_tables=tables.data_ptr(), num_aux=num_aux,
            aux_layers=0 if aux_ids is None else aux_ids.data_ptr(), aux=0 if aux is None else aux.data_ptr()))
        return x, aux
