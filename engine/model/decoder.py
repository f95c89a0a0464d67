"""The decoder-only transformer every supported family runs on: Llama (and Llama 3.x, SmolLM2),
Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3/4, OLMo 2, Granite, SmolLM3, and the
mixture-of-experts ones (Mixtral, Qwen2/3-MoE, gpt-oss: ``engine/model/moe.py``). One definition driven by the
config (``engine/model/config.py``): each family is the Llama layer with a few switches on
(q/k norms, norms after attention and MLP, GeGLU, embedding/residual/logit multipliers, logit
soft-capping, sliding-window layers with their own RoPE, partial rotary, biases).

Plain PyTorch over a FLAT token batch: ``forward(input_ids[T], positions[T], attn_metadata,
kv_caches) -> hidden[T, H]`` (after the final norm), ``compute_logits(hidden[S, H]) -> [S, V]``
fp32, only at the rows that are sampled. q/k/v are fused into one weight, gate/up into one.
With ``aux_layers=ids`` a forward also returns EAGLE-3's taps of the residual stream at the input
of those layers (``(hidden, aux)``, ``engine/model/aux_states.py``).

Batch invariance (measured on this CPU: AMD EPYC, AVX-512, torch 2.13 + MKL 2024.2, 1-2 threads)
------------------------------------------------------------------------------------------------
Greedy speculation is lossless only if a position's logits are the same BITS whether it is
computed alone (decode, 1 row), inside a (1 + k)-row verify, or inside a prefill chunk with other
requests. Findings:

* fp32 ``F.linear(x[M, K], W)`` (MKL sgemm) has three row paths: M = 1 (gemv), M in {2, 3}, M >= 4;
  rows differ bitwise between the classes for every shape tried (K, N in 64..4096, N = 49152).
  Inside the M >= 4 class a row's result does not depend on its position or on M, EXCEPT with 2
  threads, where MKL splits rows between threads and M in {5, 6, 7, 9, 10, 11} sends a 1-3 row
  remainder down another path. Padding M up to a multiple of 4 (min 4) made every row of every
  M in 1..69, 96, 128, 255, 512, 1000, 2048 bitwise equal (1 and 2 threads).
* bf16 ``F.linear`` (oneDNN): M = 1 differs from M >= 2 for some shapes (K=1536 -> 576, 64 -> 64);
  M >= 2 is invariant; the same padding covers it.
* ``F.scaled_dot_product_attention``: not invariant (fp32: 92/96 rows of chunks differ from the
  same rows decoded alone; bf16 2/96). Replaced by an explicit bmm formulation, see
  ``kernels/attention/torch_ref.py`` (query rows padded to 4, keys to >= 64, P @ V in fixed 256
  key tiles, softmax denominator from the same GEMM via a ones column).
* RMSNorm, RoPE (a precomputed table indexed by position), SiLU, residual adds: row-wise or
  elementwise; run on the same padded row count anyway.

* oneDNN fp32 linear with a PREPACKED weight (``torch.ops.mkldnn._linear_pointwise``): rows are
  bitwise invariant for every M >= 2 (M=1 differs only for some shapes, e.g. K=1536 -> 576), and
  it is much faster than MKL at small M.

Chosen approach: all linears go through oneDNN prepacked weights (``layers.Linear``; F.linear
fallback elsewhere), ``forward`` pads the flat batch to ``pad_rows(T)`` rows (a multiple of 4;
padding tokens: id 0, position 0, no KV write, output dropped) and ``compute_logits`` pads its rows
likewise (``row_multiple``; a quantized model's kernels are invariant at any row count, so it
sets 1 and is not padded: ``engine/model/quant.py``). Invariance costs some speed against the
fastest non-invariant path and is still faster than the MKL baseline (figures:
benches/RESULTS.md, "Figures behind decisions in the source").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.layers import ACTIVATIONS, Linear, gated_mlp, pad_rows, rms_norm
from tokenbudget.engine.model.moe import MoEBlock
from tokenbudget.engine.model.rope import RotaryTable
from tokenbudget.engine.model.weights import LayerWeights, WeightReader
from tokenbudget.kernels.attention.base import AttentionMetadata


class DecoderLM(torch.nn.Module):
    """Weights live in plain tensors (``self.layers``: one :class:`LayerWeights` each), not
    ``nn.Parameter`` s: the forward touches them with no module-attribute overhead. Inference only
    (no autograd). Everything a layer needs of its own (its window, its RoPE table) is on its
    ``LayerWeights``, so a view over the first N layers (the self-drafter) is a working model."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        c = self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.resolved_head_dim
        self.eps = c.rms_norm_eps
        w = WeightReader(c, state_dict, dtype, device)
        self.embed = w.get("model.embed_tokens.weight")
        self.ropes: dict[tuple, RotaryTable] = {}  # one table per distinct (theta, scaling)
        self.layers = [w.layer(i, c.layer_window(i), self._rope_for(i)) for i in range(c.num_hidden_layers)]
        self.norm = w.norm("model.norm.weight")
        if "lm_head.weight" in w.names:
            self.lm_head = Linear(w.get("lm_head.weight"))
        else:
            self.lm_head = Linear(self.embed)  # tied (oneDNN keeps its own packed copy)
        self.num_parameters = parameter_counts(self)  # (total, active per token), before any quantization
        self.rope = next(iter(self.ropes.values()))  # the C forward's table (it runs single-table models only)
        self.act = ACTIVATIONS.get(c.hidden_act, F.silu)  # swiglu_oai: the experts' own (moe.py)
        self.moe = MoEBlock(c, self.act) if c.num_experts else None
        # Rows of every GEMM are padded to this multiple (batch invariance; module doc).
        self.row_multiple = Linear.row_multiple
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rms_norm = rms_norm  # deterministic mode: the one-row-per-program Triton kernel

    def _rope_for(self, layer: int) -> RotaryTable | None:
        c = self.config
        if layer in c.nope_layers:
            return None
        theta, scaling = c.layer_rope(layer)
        key = (theta, repr(scaling))
        if key not in self.ropes:
            self.ropes[key] = RotaryTable(self.head_dim, theta, scaling, c.max_position_embeddings, self.dtype,
                                          self.device, rotary_dim=c.rotary_dim)
        return self.ropes[key]

    def reserve_positions(self, n: int) -> None:
        """Cover positions ``[0, n)`` in every RoPE table (the engine's max_model_len)."""
        for table in self.ropes.values():
            table.reserve(n)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[input_ids]
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * m

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: list[torch.Tensor], aux_layers: tuple[int, ...] | None = None):
        """The final hidden state ``[T, hidden]``; with ``aux_layers`` (EAGLE-3 taps, checked by
        ``aux_states.check_aux_layers``) ``(hidden, aux)``, ``aux [T, len(aux_layers) * hidden]``
        float32 (``engine/model/aux_states.py``)."""
        t = input_ids.shape[0]
        tp = pad_rows(t, self.row_multiple)
        if tp != t:  # batch invariance: every GEMM sees a multiple-of-4 row count
            input_ids = F.pad(input_ids, (0, tp - t))
            positions = F.pad(positions, (0, tp - t))
        x = self.embed_tokens(input_ids)
        rotations = {id(r): r.lookup(positions) for r in self.ropes.values()}
        rotations[id(None)] = None  # a NoPE layer
        taps, tapped = aux_layers, {}
        for i, (lw, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if taps and i in taps:
                tapped[i] = x  # x is rebound below, never written in place
            x = self.layer(lw, x, rotations[id(lw.rope)], attn_metadata, kv_cache)
        hidden = self.rms_norm(x, self.norm, self.eps)[:t]
        if taps:
            return hidden, torch.cat([tapped[i][:t] for i in taps], dim=1).float()
        return hidden

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else self.rms_norm(x, weight, self.eps)

    def layer(self, lw: LayerWeights, x: torch.Tensor, rotation, md: AttentionMetadata,
              kv_cache: torch.Tensor | None) -> torch.Tensor:
        """One decoder layer on the residual stream ``x [Tp, hidden]``: ``rotation`` is the
        layer's RoPE table looked up at the rows' positions (None: no RoPE), the attention goes through
        ``md.backend`` (the training forward passes a dense one). Returns the new stream."""
        tp, c = x.shape[0], self.config
        h, hk, d, q_size, kv_size = self.num_heads, self.num_kv_heads, self.head_dim, self.q_size, self.kv_size
        qkv = lw.qkv(self._norm(x, lw.attn_in_norm))
        v = qkv[:, q_size + kv_size:].view(tp, hk, d)
        if c.qk_norm == "none" and rotation is not None:  # q and k heads rotated in one call
            qk = lw.rope.apply(qkv[:, :q_size + kv_size].view(tp, h + hk, d), *rotation)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
            if c.qk_norm == "proj":  # OLMo 2: over the whole projection, before the heads split
                q, k = self._norm(q, lw.q_norm), self._norm(k, lw.k_norm)
            q, k = q.reshape(tp, h, d), k.reshape(tp, hk, d)
            if c.qk_norm == "head":  # Qwen3, Gemma 3: over each head
                q, k = self._norm(q, lw.q_norm), self._norm(k, lw.k_norm)
            if rotation is not None:  # None: a NoPE layer (SmolLM3)
                q, k = lw.rope.apply(q, *rotation), lw.rope.apply(k, *rotation)
        backend = md.backend
        backend.write_kv(k, v, kv_cache, md)
        attn = backend.attend(q, kv_cache, md, lw.window, lw.sinks)
        x = self._residual(x, self._norm(lw.o(attn.reshape(tp, q_size)), lw.attn_out_norm))
        h = self._norm(x, lw.mlp_in_norm)
        mlp = self.moe(lw.moe, h) if lw.moe is not None else gated_mlp(h, lw.gate_up, lw.down, self.act)
        return self._residual(x, self._norm(mlp, lw.mlp_out_norm))

    def _residual(self, x: torch.Tensor, block_out: torch.Tensor) -> torch.Tensor:
        m = self.config.residual_multiplier
        return x + block_out if m == 1.0 else x + block_out * m

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S, H]`` -> fp32 logits ``[S, V]`` (rows padded like ``forward``), with the
        family's final scaling (Granite) and soft-cap (Gemma 2)."""
        s = hidden.shape[0]
        sp = pad_rows(s, self.row_multiple)
        if sp != s:
            hidden = F.pad(hidden, (0, 0, 0, sp - s))
        logits = self.lm_head.fp32_out(hidden.contiguous())[:s]
        return finish_logits(logits, self.config)


def parameter_counts(model: DecoderLM) -> tuple[int, int]:
    """``(total, active per token)`` parameters of a built model (a tied head counted once): they
    differ for an MoE model, whose tokens run their top k of num_experts experts."""
    def size(*items) -> int:
        n = 0
        for x in items:
            if isinstance(x, torch.Tensor):
                n += x.numel()
            elif x is not None:  # a Linear
                n += x.weight.numel() + (0 if x.bias is None else x.bias.numel())
        return n

    c = model.config
    total = size(model.embed, model.norm) + (0 if model.lm_head.weight is model.embed else size(model.lm_head))
    active = total
    for lw in model.layers:
        dense = size(lw.qkv, lw.o, lw.gate_up, lw.down, lw.attn_in_norm, lw.attn_out_norm, lw.mlp_in_norm,
                     lw.mlp_out_norm, lw.q_norm, lw.k_norm, lw.sinks)
        total, active = total + dense, active + dense
        if (m := lw.moe) is not None:
            shared = size(m.router, m.shared_gate_up, m.shared_down, m.shared_gate)
            experts = [size(g, d) for g, d in zip(m.gate_up, m.down)]
            total += shared + sum(experts)
            active += shared + c.num_experts_per_tok * max(experts)
    return total, active


def finish_logits(logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The family's last touch on the LM head's fp32 output, in transformers' order."""
    if config.logits_scaling != 1.0:
        logits = logits / config.logits_scaling
    if (cap := config.final_logit_softcapping) is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
