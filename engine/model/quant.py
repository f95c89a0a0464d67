"""Weight-only quantized linears for the CPU (``quantization`` = ``int8`` | ``int4``).

``quantize_model(model, mode)`` replaces every ``layers.Linear`` of a built ``DecoderLM``
(q/k/v, o, gate/up, down, lm_head) by a :class:`QuantLinear` holding only the packed weight and
its scales: the fp32 weight and its oneDNN-packed copy are dropped, so no second copy of the
weights is kept. The token embedding is a row lookup, not a GEMM: it becomes a
:class:`Q8Embedding` (int8 codes and an fp16 scale per 32 columns, a quarter of the float table)
when that form holds its values exactly — as it does for a GGUF whose table is Q8_0, the default
model's — and stays the float table otherwise.

The lm_head is int8 in both modes (:data:`LM_HEAD_MODE`), as GGUF Q4 files keep it (the default
model's tied embedding is Q8_0): an int4 head costs far more perplexity than the int8 head costs
decode speed (figures:
benches/RESULTS.md, "Figures behind decisions in the source").

Kernels, chosen per linear (``QuantLinear.kernel``):
* ``native`` (where the CPU has AVX-512 VNNI, a C compiler is found and in_features is a multiple
  of 32; ``kernels/cpu``): our C GEMMs. The activations are quantized per row and group of 32 to
  int8 inside the call (GGUF's Q8 activations, as llama.cpp does) and multiplied as integers
  (vpdpbusd); int4 weights are GGUF Q4_1's (codes, fp16 d and m per group of 32), laid out by
  blocks of 16 output columns (one register lane per column: no horizontal sums). When every
  linear of the model runs natively, ``quantize_model`` also installs the whole decoder in one C
  call around the model (``engine/model/cpu_forward.py``; figures: benches/RESULTS.md, "C kernels
  on the CPU").
* ``torch``: torch's CPU weight-only GEMMs. The activations enter the kernel in bf16 and its
  output is cast back to fp32: in torch 2.13 both kernels are vectorized (AVX-512) only for bf16
  inputs (with fp32 inputs they ran 20-40x slower than the fp32 oneDNN linear, ``benches/
  quant_kernels.py --act float32``). ``int8``: ``aten._weight_int8pack_mm``, symmetric per output
  channel (``w ~= q * s``, q in [-127, 127]). ``int4``: ``aten._weight_int4pack_mm_for_cpu``,
  asymmetric per group of ``group_size`` input columns (``w ~= (q - 8) * s + z``, z = min + 8 s).
With group 32 both int4 kernels use GGUF Q4_1's arithmetic (block 32, ``w = q d + m``):
requantizing a Q4_1 tensor's dequantized values gives back its codes, so ``int4`` on a Q4_1 file
reproduces the file's weights.

Batch invariance: every kernel computes a row's outputs from that row alone for EVERY row count,
1 included (torch's: measured for M in 1..19, 31, 33, 64, 70 on the default model's shapes, 1 and
2 threads, ``benches/quant_kernels.py``; ours by construction; enforced by
``tests/test_batch_invariance.py`` and ``tests/test_cpu_kernels.py``). So a quantized model
needs no row padding (``row_multiple = 1``): a batch-1 decode runs the kernels' M=1 path, faster
than the M=4 one (figures:
benches/RESULTS.md, "Figures behind decisions in the source").
"""

from __future__ import annotations

import torch

from tokenbudget.engine.model.cpu_forward import CpuForwardModel
from tokenbudget.engine.model.layers import Linear
from tokenbudget.kernels.cpu import quant_gemm as cpu_gemm

QUANTIZATIONS = ("none", "int8", "int4")
LM_HEAD_MODE = "int8"
INT4_GROUP_SIZE = 32       # GGUF Q4_0/Q4_1 block size
_INT4_INNER_K_TILES = 2    # the packing layout expected by the CPU int4 kernel


def _int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def _int4_groupwise(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (codes ``[N, K]`` in [0, 15], scales, mins ``[N, K / group]``) with
    ``w ~= codes * scale + min`` (GGUF Q4_1's arithmetic)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.int32).reshape(n, k)
    return q, scales, lo


def _int4_torch_pack(q: torch.Tensor, scales: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes -> torch's CPU int4 kernel layout: (packed weight, scales_and_zeros ``[K / group, Np, 2]``)
    with ``w ~= (q - 8) * s + z``; the kernel needs N a multiple of 16, so N is padded with zero
    rows to ``Np`` (the caller drops those outputs)."""
    pad = -q.shape[0] % 16
    q, scales, lo = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, scales, lo))
    sz = torch.stack([scales, lo + 8.0 * scales], -1).transpose(0, 1).contiguous()  # [K/g, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), _INT4_INNER_K_TILES)
    return packed, sz


class QuantLinear:
    """``y = x @ dequant(Wq).T + b`` with a weight-only quantized ``Wq`` (see module doc): the C
    kernels' weight (``native``: ``Q4Weight`` / ``Q8Weight``) where they run, else torch's packed
    weight and scales."""

    __slots__ = ("act_dtype", "bias", "group_size", "mode", "native", "out_features", "packed", "scales")
    row_multiple = 1  # rows invariant at any row count (module doc)

    def __init__(self, mode: str, bias: torch.Tensor | None, out_features: int, *, native=None,
                 packed: torch.Tensor | None = None, scales: torch.Tensor | None = None, group_size: int = 0,
                 act_dtype: torch.dtype = torch.bfloat16):
        self.mode, self.bias, self.out_features, self.native = mode, bias, out_features, native
        self.packed, self.group_size, self.act_dtype = packed, group_size, act_dtype
        self.scales = None if scales is None else scales.to(act_dtype)  # torch's kernels: activation dtype

    @property
    def kernel(self) -> str:
        return "native" if self.native is not None else "torch"

    @classmethod
    def from_float(cls, weight: torch.Tensor, mode: str, bias: torch.Tensor | None = None,
                   group_size: int = INT4_GROUP_SIZE, act_dtype: torch.dtype = torch.bfloat16,
                   kernel: str = "auto") -> QuantLinear:
        """``kernel``: ``native`` (the C kernels; ValueError where they cannot run), ``torch``, or
        ``auto`` (native where it runs: AVX-512 VNNI, in_features a multiple of 32, group 32)."""
        w = weight.detach().float()
        n, k = w.shape
        if mode not in QUANTIZATIONS[1:]:
            raise ValueError(f"quantization must be one of {'/'.join(QUANTIZATIONS[1:])}, got {mode!r}")
        if mode == "int4" and (k % group_size or group_size not in (32, 64, 128, 256)):
            raise ValueError(f"int4 needs in_features ({k}) divisible by group_size ({group_size})")
        native_ok = cpu_gemm.supports(k) and (mode == "int8" or group_size == cpu_gemm.GROUP)
        if kernel == "native" and not native_ok:
            raise ValueError(f"kernel='native' cannot run this linear (in_features {k}, group {group_size}, "
                             f"C kernels available: {cpu_gemm.library() is not None})")
        use_native = kernel == "native" or (kernel == "auto" and native_ok)
        if mode == "int8":
            q, s = _int8_per_channel(w)
            if use_native:
                return cls(mode, bias, n, native=cpu_gemm.Q8Weight.from_codes(q, s))
            return cls(mode, bias, n, packed=q, scales=s, act_dtype=act_dtype)
        q, scales, lo = _int4_groupwise(w, group_size)
        if use_native:
            return cls(mode, bias, n, native=cpu_gemm.Q4Weight.from_codes(q, scales, lo))
        packed, sz = _int4_torch_pack(q, scales, lo)
        return cls(mode, bias, n, packed=packed, scales=sz, group_size=group_size, act_dtype=act_dtype)

    def fp32_out(self, x: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 (the lm_head's call, like ``Linear.fp32_out``)."""
        return self(x).float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            y = cpu_gemm.gemm_q4(x, self.native) if self.mode == "int4" else cpu_gemm.gemm_q8(x, self.native)
            return y if self.bias is None else y + self.bias
        out_dtype = x.dtype
        x = x.to(self.act_dtype).contiguous()
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales)
            y = y[:, :self.out_features]
        y = y.to(out_dtype)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        if self.native is not None:
            return self.native.nbytes()
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


class Q8Embedding:
    """Token embedding rows kept as GGUF Q8_0 (``codes`` int8 ``[V, H]``, ``scales`` fp16
    ``[V, H / 32]``, row value = code * scale) and dequantized per lookup: ``embed[ids]`` returns
    exactly the float rows it was built from (:meth:`exact_from` refuses any table it cannot
    hold bit for bit), so the model computes what it computed with the float table. The default
    model's 49152 x 576 table: 113 MB as fp32, 30 MB here."""

    __slots__ = ("codes", "scales")
    GROUP = 32
    ROWS_PER_CHUNK = 4096  # the exactness check's transient memory stays a few MB

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.codes, self.scales = codes, scales

    @classmethod
    def exact_from(cls, table: torch.Tensor) -> Q8Embedding | None:
        """The Q8_0 form of a float32 CPU ``table`` if it holds every value exactly, else None.
        A table dequantized from Q8_0 round-trips: each block's largest code is +-127, so
        ``max|w| / 127`` gives back its fp16 scale and ``w / scale`` its codes."""
        g = cls.GROUP
        if table.dtype != torch.float32 or table.device.type != "cpu" or table.dim() != 2 or table.shape[1] % g:
            return None
        v, h = table.shape
        codes = torch.empty(v, h, dtype=torch.int8)
        scales = torch.empty(v, h // g, dtype=torch.float16)
        for r0 in range(0, v, cls.ROWS_PER_CHUNK):
            blocks = table[r0:r0 + cls.ROWS_PER_CHUNK].view(-1, h // g, g)
            d = (blocks.abs().amax(-1) / 127).to(torch.float16)
            df = d.float().unsqueeze(-1)
            q = torch.where(df > 0, torch.round(blocks / df.clamp_min(torch.finfo(torch.float32).tiny)), 0.0)
            if q.abs().max() > 127 or not torch.equal(q * df, blocks):
                return None
            codes[r0:r0 + blocks.shape[0]] = q.view(-1, h).to(torch.int8)
            scales[r0:r0 + blocks.shape[0]] = d
        return cls(codes, scales)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes[ids]
        n, h = codes.shape[:-1], codes.shape[-1]
        rows = codes.float().view(*n, h // self.GROUP, self.GROUP) * self.scales[ids].float().unsqueeze(-1)
        return rows.view(*n, h)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # what a lookup returns

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 2


def quantize_model(model, mode: str):
    """Swap every ``Linear`` of ``model`` (a built ``DecoderLM`` on the CPU, fp32) for a
    ``QuantLinear`` in place and return it, wrapped in the C decoder forward where that runs
    (``CpuForwardModel``: use the returned object); ``none`` returns it unchanged."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {'/'.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return model
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise ValueError(f"quantization={mode!r} needs the CPU fp32 model (device cpu, dtype float32), "
                         f"got {model.device.type}/{model.dtype}")

    def q(lin: Linear, m: str = mode) -> QuantLinear:
        return QuantLinear.from_float(lin.weight, m, lin.bias)

    for lw in model.layers:
        lw.map_linears(q)
    model.lm_head = q(model.lm_head, LM_HEAD_MODE)  # (a tied head reads the float table first)
    model.embed = Q8Embedding.exact_from(model.embed) or model.embed
    model.quantization = mode
    model.row_multiple = QuantLinear.row_multiple
    return CpuForwardModel.around(model)
