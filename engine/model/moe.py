"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE, gpt-oss): a router picks
``num_experts_per_tok`` experts per row, each chosen expert runs its gated MLP on the rows that
chose it, and a row's output is the routing-weighted sum of its experts' outputs (plus a gated
shared expert where the config has one).

Execution is grouped by expert, never a loop over tokens: per step, for each expert that some row
chose (ascending expert id), one GEMM over exactly those rows. Batch invariance holds as for the
dense layers: each expert's rows are padded to the GEMMs' ``row_multiple`` (a row's bits do not
depend on how many other rows chose the same expert; ``engine/model/decoder.py``'s measurements),
and a row's contributions are added in ascending expert id, an order fixed by the row's own
choice (transformers adds them in the same order). The routing itself is row-wise.

Routers (``ModelConfig.moe_router``): ``softmax_topk`` — softmax over all experts in fp32, the
top k, renormalised to sum 1 when ``norm_topk_prob`` (Mixtral always; Qwen3-MoE per config);
``topk_softmax`` — the top k router logits (router bias added), softmax over those k (gpt-oss).
Activations: SwiGLU, or gpt-oss's clamped one (``swiglu_oai``: gate clamped above at ``limit``,
up to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenbudget.engine.model.layers import Linear, pad_rows


@dataclass(slots=True)
class MoEWeights:
    """One layer's experts: ``router [E, hidden]`` (+ bias), per expert a fused gate/up
    ``[2 I, hidden]`` and a down ``[hidden, I]`` linear (with biases for gpt-oss), and an optional
    shared expert with its sigmoid gate ``[1, hidden]`` (Qwen2-MoE)."""

    router: Linear
    gate_up: list[Linear]
    down: list[Linear]
    shared_gate_up: Linear | None = None
    shared_down: Linear | None = None
    shared_gate: Linear | None = None


def route(logits: torch.Tensor, top_k: int, router: str, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]``)."""
    if router == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, ids


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (transformers' ``GptOssExperts._apply_gate``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MoEBlock:
    """The MLP of an MoE layer; ``__call__(x [Tp, hidden]) -> [Tp, hidden]``."""

    def __init__(self, config, act) -> None:
        self.top_k, self.router = config.num_experts_per_tok, config.moe_router
        self.norm_topk_prob = config.norm_topk_prob
        self.act = act  # the dense layers' activation (SiLU) unless swiglu_oai
        self.oai = config.hidden_act == "swiglu_oai"
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    def _expert(self, x: torch.Tensor, gate_up: Linear, down: Linear) -> torch.Tensor:
        gu = gate_up(x)
        inter = gu.shape[-1] // 2
        g, u = gu[:, :inter], gu[:, inter:]
        return down(swiglu_oai(g, u, self.alpha, self.limit) if self.oai else self.act(g) * u)

    def __call__(self, w: MoEWeights, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(w.router.fp32_out(x), self.top_k, self.router, self.norm_topk_prob)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():  # one grouped GEMM per chosen expert (ascending id)
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            n = rows.shape[0]
            xe = x.index_select(0, rows)
            padded = pad_rows(n, w.gate_up[e].row_multiple)
            if padded != n:  # batch invariance: the GEMMs see a multiple of their row count
                xe = F.pad(xe, (0, 0, 0, padded - n))
            ye = self._expert(xe, w.gate_up[e], w.down[e])[:n].float()
            out.index_add_(0, rows, ye * weights[rows, slot, None])
        if w.shared_gate_up is not None:
            shared = self._expert(x, w.shared_gate_up, w.shared_down).float()
            out = out + torch.sigmoid(w.shared_gate.fp32_out(x)) * shared
        return out.to(x.dtype)
