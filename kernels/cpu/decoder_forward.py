"""The C decoder forward's interface (``tb_forward`` in ``decoder_forward.c``), described once.

``TbForward`` / ``TbLayer`` / ``TbLinear`` mirror the C structs field for field (ctypes lays them
out by the same C ABI rules), so a field is added in two struct definitions and nowhere else:
no positional argument lists, no table width written in both languages.
"""

from __future__ import annotations

import ctypes

from tokenbudget.kernels.cpu.native import library

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class TbLinear(ctypes.Structure):
    """One quantized linear: ``fmt`` 4 (q4) or 8 (q8), packed weights, q8 scales, bias (or 0)."""

    _fields_ = [("fmt", _I64), ("w", _P), ("s", _P), ("bias", _P)]


class TbLayer(ctypes.Structure):
    """One decoder layer: norm weights by role (0: the layer has none), q/k norms, its RoPE table
    (0: no RoPE), its KV cache ``[blocks, 2, block_size, Hk, D]``, linears, its sliding window (0: none)."""

    _fields_ = [("attn_in_norm", _P), ("attn_out_norm", _P), ("mlp_in_norm", _P), ("mlp_out_norm", _P),
                ("q_norm", _P), ("k_norm", _P), ("cos", _P), ("sin", _P), ("kv", _P),
                ("qkv", TbLinear), ("o", TbLinear), ("gate_up", TbLinear), ("down", TbLinear), ("window", _I64)]


class TbForward(ctypes.Structure):
    """One call: the shapes, the layers, and the step's flat batch (decoder_forward.c says what
    each buffer holds)."""

    _fields_ = [("num_tokens", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("intermediate", _I64), ("num_layers", _I64), ("block_size", _I64),
                ("max_blocks", _I64), ("num_threads", _I64), ("qk_norm", _I64), ("rotary_dim", _I64),
                ("gelu", _I64), ("eps", _F32), ("scale", _F32), ("residual_mult", _F32), ("softcap", _F32),
                ("layers", ctypes.POINTER(TbLayer)), ("x", _P), ("positions", _P),
                ("slots", _P), ("row_ctx", _P), ("row_req", _P), ("block_tables", _P),
                ("num_aux", _I64), ("aux_layers", _P), ("aux", _P)]


def tb_forward(args: TbForward) -> None:
    """Run the forward; MemoryError when the C side could not allocate its scratch buffers."""
    if library().tb_forward(ctypes.byref(args)):
        raise MemoryError("tb_forward: scratch allocation failed")
