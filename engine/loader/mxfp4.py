"""MXFP4 expert weights (gpt-oss's published checkpoints) -> float tensors at load.

A gpt-oss checkpoint stores each expert projection as ``<name>_blocks`` (uint8 ``[E, rows, G, 16]``:
32 FP4 E2M1 values per group, two per byte, low nibble first) and ``<name>_scales`` (uint8
``[E, rows, G]``: one E8M0 exponent per group of 32, biased by 127), ``rows`` being the output
dimension. The value of element ``j`` of a group is ``FP4[nibble] * 2 ** (scale - 127)``. The
dequantized tensor is written in the layout of gpt-oss's unquantized checkpoints, ``[E, in, out]``
(what ``engine/model/weights.py`` reads), as transformers' ``convert_moe_packed_tensors`` does.

No kernel runs MXFP4 yet: the experts are dequantized to the model's dtype once, at load, and
the loader says so.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [E, rows, G, 16]`` uint8 + ``scales [E, rows, G]`` uint8 -> ``[E, G * 32, rows]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)}: expected uint8 "
                         "[E, rows, G, 16] and [E, rows, G]")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    e, rows, g, _ = blocks.shape
    values = torch.empty(e, rows, g, 32, dtype=torch.float32)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.view(e, rows, g * 32).transpose(1, 2).contiguous().to(dtype)


def mxfp4_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Header shapes with each ``X_blocks`` / ``X_scales`` pair as the ``X`` it dequantizes to
    (``[E, G * 32, rows]``), so a check sees the tensors the model reads."""
    out = dict(shapes)
    for name in [k[:-len("_blocks")] for k in shapes if k.endswith("_blocks")]:
        blocks = out.pop(name + "_blocks")
        scales = out.pop(name + "_scales", None)
        if scales is None or len(blocks) != 4 or blocks[-1] != 16 or tuple(blocks[:-1]) != tuple(scales):
            raise ValueError(f"MXFP4 tensor {name}: blocks {blocks} / scales {scales}, expected [E, rows, G, 16] "
                             "and [E, rows, G]")
        out[name] = (blocks[0], blocks[2] * 32, blocks[1])
    return out


def dequantize_state_dict(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Replace every ``X_blocks`` / ``X_scales`` pair of ``state_dict`` by ``X`` in place."""
    pairs = [k[:-len("_blocks")] for k in state_dict if k.endswith("_blocks")]
    for name in pairs:
        scales = state_dict.pop(name + "_scales", None)
        if scales is None:
            raise ValueError(f"{name}_blocks has no {name}_scales beside it (an MXFP4 tensor needs both)")
        state_dict[name] = dequantize_mxfp4(state_dict.pop(name + "_blocks"), scales, dtype)
    if pairs:
        logger.info("tokenbudget: %d MXFP4 expert tensors dequantized to %s at load (no MXFP4 kernel yet)",
                    len(pairs), str(dtype).removeprefix("torch."))
