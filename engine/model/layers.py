"""Row-wise building blocks of the decoder, written for batch invariance.

Every op here is either elementwise or row-wise, or a GEMM whose row count is padded to a
multiple of the GEMM's ``row_multiple`` by the caller (``DecoderLM.forward`` pads the flat batch
once, to the largest multiple among its linears). See ``engine/model/decoder.py`` for the
measurements behind it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 4  # float GEMMs (MKL / oneDNN): rows are invariant only in multiples of 4


def pad_rows(n: int, multiple: int = ROW_MULTIPLE) -> int:
    """Padded row count: the smallest multiple of ``multiple`` >= n (and >= ``multiple``)."""
    return max(multiple, -(-n // multiple) * multiple)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale. fp32 activations take torch's
    fused kernel (one op instead of seven; row-wise, so batch-invariant; same bits here)."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


def gated_mlp(x: torch.Tensor, gate_up: Linear, down: Linear, act=F.silu) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with gate/up fused into one ``[2I, H]`` weight (SwiGLU with
    SiLU; Gemma's GeGLU with tanh-approximated GELU)."""
    gu = gate_up(x)
    inter = gu.shape[-1] // 2
    return down(act(gu[:, :inter]) * gu[:, inter:])


def _prepack(weight: torch.Tensor):
    """oneDNN-prepacked copy of ``weight`` for CPU fp32/bf16, or None (then F.linear is used).

    Why: MKL's fp32 sgemm behind F.linear is batch-variant (M=1 | 2-3 | >=4 row paths) and at
    M=4 costs a multiple of a gemv; oneDNN's prepacked fp32 linear is row-invariant for M >= 2 (and
    for M=1 on most shapes) and as fast at M=1-4 as MKL's gemv (figures: benches/RESULTS.md,
    "Figures behind decisions in the source").
    ``TOKENBUDGET_NO_ONEDNN=1`` disables it.
    """
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16)
            or os.environ.get("TOKENBUDGET_NO_ONEDNN") or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (RuntimeError, AttributeError):
        return None


_UNSET = object()


class Linear:
    """``y = x @ W.T + b`` through oneDNN with a prepacked weight when available. The prepacked
    copy is made at the first call, so a linear that is quantized before it runs (``quant.py``)
    never pays for one (0.5 s of the default model's start-up)."""

    __slots__ = ("weight", "bias", "_packed", "invariant", "_fp32")
    row_multiple = ROW_MULTIPLE

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self._packed = _UNSET
        self.invariant = False  # deterministic mode: the batch-invariant Triton matmul
        self._fp32: Linear | None = None  # CPU fp32 copy for fp32_out, made on first use

    @property
    def packed(self):
        """The oneDNN-prepacked weight, or None where it does not apply (``_prepack``)."""
        if self._packed is _UNSET:
            self._packed = _prepack(self.weight)
        return self._packed

    def _invariant(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        from tokenbudget.kernels.batch_invariant_matmul import matmul_batch_invariant
        y = matmul_batch_invariant(x, self.weight, out_dtype=out_dtype)
        return y if self.bias is None else y + self.bias.to(out_dtype)

    def fp32_out(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` accumulated AND returned in fp32 (logits): rounding a bf16/fp16 GEMM's
        output before ``.float()`` turns tiny differences into argmax flips."""
        if x.dtype == torch.float32:
            return self(x)
        if self.invariant:
            return self._invariant(x, torch.float32)
        if x.device.type == "cuda":
            y = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
            return y if self.bias is None else y + self.bias.float()
        if self._fp32 is None:  # CPU: a prepacked fp32 copy (upcasting per call costs ~25x)
            self._fp32 = Linear(self.weight.float(), None if self.bias is None else self.bias.float())
        return self._fp32(x.float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return self._invariant(x, x.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
