"""Row-wise building blocks for the Llama family, written for batch invariance.

Every op here is either elementwise or row-wise, or a GEMM whose row count is padded to a
multiple of :data:`ROW_MULTIPLE` by the caller (``LlamaForCausalLM.forward`` pads the flat batch
once). See ``engine/model/llama.py`` for the measurements behind it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 4


def pad_rows(n: int) -> int:
    """Padded row count: the smallest multiple of ROW_MULTIPLE >= n (and >= ROW_MULTIPLE)."""
    return max(ROW_MULTIPLE, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with gate/up fused into one ``[2I, H]`` weight."""
    gu = F.linear(x, gate_up)
    inter = gu.shape[-1] // 2
    return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down)
