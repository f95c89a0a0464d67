"""The EAGLE-3 head's C forward (``tb_eagle3`` in ``eagle3_head.c``), described once: ``TbEagle3``
mirrors the C struct field for field, as ``decoder_forward.py`` does for ``tb_forward``."""

from __future__ import annotations

import ctypes

from tokenbudget.kernels.cpu.decoder_forward import TbLinear
from tokenbudget.kernels.cpu.native import library

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class TbEagle3(ctypes.Structure):
    """One call: the head's shape and weights, and the rows in segments (eagle3_head.c says what
    each buffer holds)."""

    _fields_ = [("num_rows", _I64), ("num_segments", _I64), ("hidden", _I64), ("num_heads", _I64),
                ("num_kv_heads", _I64), ("head_dim", _I64), ("intermediate", _I64), ("draft_vocab", _I64),
                ("num_threads", _I64), ("norm_before_residual", _I64), ("aux_width", _I64),
                ("eps", _F32), ("scale", _F32),
                ("input_norm", _P), ("hidden_norm", _P), ("post_norm", _P), ("norm", _P),
                ("fc", TbLinear), ("q", TbLinear), ("k", TbLinear), ("v", TbLinear), ("o", TbLinear),
                ("gate", TbLinear), ("up", TbLinear), ("down", TbLinear), ("lm_head", TbLinear),
                ("token_ids", _P), ("embed_f32", _P), ("embed_codes", _P), ("embed_scales", _P),
                ("aux", _P), ("hidden_in", _P), ("positions", _P), ("cos", _P), ("sin", _P),
                ("seg_kv", _P), ("seg_cap", _P), ("seg_at", _P), ("seg_rows", _P), ("d2t", _P),
                ("h_out", _P), ("logits", _P), ("greedy", _P)]


def tb_eagle3(args: TbEagle3) -> None:
    """Run the head; MemoryError when the C side could not allocate its scratch buffers."""
    if library().tb_eagle3(ctypes.byref(args)):
        raise MemoryError("tb_eagle3: scratch allocation failed")
