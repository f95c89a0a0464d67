"""The training side's arithmetic: bfloat16 autocast where the CPU multiplies bfloat16 natively.

``"auto"`` picks bfloat16 on CPUs with AVX512-BF16 or AMX, float32 elsewhere (without them torch
emulates bfloat16 and is slower than float32). Only matmuls run in bfloat16: the residual stream,
norms, the loss, the master weights and the optimizer stay float32. On an AMD EPYC with
AVX512-BF16 a training batch and the tap-state forward run about twice as fast, and the tap
states differ from float32 less than the engine's int4 states (what the head reads when it
serves) differ from either (benches/RESULTS.md, "Figures behind decisions in the source").
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

PRECISIONS = ("auto", "bfloat16", "float32")


def resolve(precision: str) -> str:
    """``"auto"`` -> ``"bfloat16"`` or ``"float32"`` for this CPU; others are checked and kept."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return "bfloat16" if native else "float32"
    return precision


@contextlib.contextmanager
def autocast(precision: str) -> Iterator[None]:
    """The autocast context of a resolved precision (a no-op for float32). Silences the warning
    that ``rms_norm`` of a bfloat16 input with a float32 weight takes the unfused path."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            yield
