"""Llama-family decoder (Llama, Mistral, Qwen2 with q/k/v bias, SmolLM2 with tied embeddings).

Plain PyTorch over a FLAT token batch: ``forward(input_ids[T], positions[T], attn_metadata,
kv_caches) -> hidden[T, H]`` (after the final norm), ``compute_logits(hidden[S, H]) -> [S, V]``
fp32, only at the rows that are sampled. q/k/v are fused into one weight, gate/up into one.
With ``set_aux_layers(ids)`` each forward also keeps ``aux_hidden_states`` (EAGLE-3's taps of the
residual stream at the input of those layers, ``engine/model/aux_states.py``).

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenbudget.engine.model.aux_states import check_aux_layers
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.layers import Linear, pad_rows, rms_norm, swiglu
from tokenbudget.engine.model.rope import RotaryTable
from tokenbudget.kernels.attention.base import AttentionMetadata


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear                  # [(H + 2 Hk) * D, hidden] (+ bias for Qwen2)
    o: Linear                    # [hidden, H * D]
    post_norm: torch.Tensor
    gate_up: Linear              # [2 I, hidden]
    down: Linear                 # [hidden, I]


def _layer_from_hf(sd: dict[str, torch.Tensor], i: int, bias: bool, dtype, device) -> LayerWeights:
    p = f"model.layers.{i}."

    def get(name: str) -> torch.Tensor:
        try:
            return sd[p + name]
        except KeyError:
            raise ValueError(f"state_dict is missing {p + name}") from None

    def cvt(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype=dtype, device=device).contiguous()

    qkv = cvt(torch.cat([get(f"self_attn.{n}_proj.weight") for n in "qkv"]))
    qkv_bias = (cvt(torch.cat([get(f"self_attn.{n}_proj.bias") for n in "qkv"])) if bias else None)
    gate_up = cvt(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]))
    return LayerWeights(cvt(get("input_layernorm.weight")), Linear(qkv, qkv_bias),
                        Linear(cvt(get("self_attn.o_proj.weight"))),
                        cvt(get("post_attention_layernorm.weight")),
                        Linear(gate_up), Linear(cvt(get("mlp.down_proj.weight"))))


class LlamaForCausalLM(torch.nn.Module):
    """Weights live in plain tensors (``self.layers``), not ``nn.Parameter`` s: the forward
    touches them with no module-attribute overhead. Inference only (no autograd)."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.resolved_head_dim
        self.eps = config.rms_norm_eps
        bias = config.attention_bias or "model.layers.0.self_attn.q_proj.bias" in state_dict
        if "model.embed_tokens.weight" not in state_dict:
            raise ValueError("state_dict is missing model.embed_tokens.weight")
        self.embed = state_dict["model.embed_tokens.weight"].to(dtype=dtype, device=device)
        self.layers = [_layer_from_hf(state_dict, i, bias, dtype, device)
                       for i in range(config.num_hidden_layers)]
        self.norm = state_dict["model.norm.weight"].to(dtype=dtype, device=device)
        if config.tie_word_embeddings or "lm_head.weight" not in state_dict:
            self.lm_head = Linear(self.embed)  # tied (oneDNN keeps its own packed copy)
        else:
            self.lm_head = Linear(state_dict["lm_head.weight"].to(dtype=dtype, device=device).contiguous())
        self.rope = RotaryTable(self.head_dim, config.rope_theta, config.rope_scaling,
                                config.max_position_embeddings, dtype, device)
        # Rows of every GEMM are padded to this multiple (batch invariance; module doc).
        self.row_multiple = Linear.row_multiple
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rms_norm = rms_norm  # deterministic mode: the one-row-per-program Triton kernel
        # EAGLE-3 taps (engine/model/aux_states.py): the layers whose input residual stream each
        # forward keeps, and the last forward's states [T, len(aux_layers) * hidden] float32.
        self.aux_layers: tuple[int, ...] | None = None
        self.aux_hidden_states: torch.Tensor | None = None

    def set_aux_layers(self, ids) -> None:
        """Keep the residual stream at the input of layers ``ids`` in each forward (None: none)."""
        self.aux_layers = check_aux_layers(ids, len(self.layers))
        self.aux_hidden_states = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        t = input_ids.shape[0]
        tp = pad_rows(t, self.row_multiple)
        if tp != t:  # batch invariance: every GEMM sees a multiple-of-4 row count
            input_ids = F.pad(input_ids, (0, tp - t))
            positions = F.pad(positions, (0, tp - t))
        backend = attn_metadata.backend
        h, hk, d, q_size, kv_size = self.num_heads, self.num_kv_heads, self.head_dim, self.q_size, self.kv_size
        cos, sin = self.rope.lookup(positions)
        x = self.embed[input_ids]
        taps, tapped = self.aux_layers, {}
        self.aux_hidden_states = None
        for i, (lw, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if taps and i in taps:
                tapped[i] = x  # x is rebound below, never written in place
            hs = self.rms_norm(x, lw.input_norm, self.eps)
            qkv = lw.qkv(hs)
            qk = self.rope.apply(qkv[:, :q_size + kv_size].view(tp, h + hk, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, q_size + kv_size:].view(tp, hk, d)
            backend.write_kv(k, v, kv_cache, attn_metadata)
            attn = backend.attend(q, kv_cache, attn_metadata)
            x = x + lw.o(attn.reshape(tp, q_size))
            x = x + swiglu(self.rms_norm(x, lw.post_norm, self.eps), lw.gate_up, lw.down)
        if taps:
            self.aux_hidden_states = torch.cat([tapped[i][:t] for i in taps], dim=1).float()
        return self.rms_norm(x, self.norm, self.eps)[:t]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S, H]`` -> fp32 logits ``[S, V]`` (rows padded like ``forward``)."""
        s = hidden.shape[0]
        sp = pad_rows(s, self.row_multiple)
        if sp != s:
            hidden = F.pad(hidden, (0, 0, 0, sp - s))
        return self.lm_head.fp32_out(hidden.contiguous())[:s]
