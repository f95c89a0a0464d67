"""The C kernel variants (``kernels/cpu/native.py``) as a pytest parameter (conftest's ``variant``): every variant, run
where this CPU can execute it (``scalar`` everywhere), skipped naming the missing instructions
where it cannot. A variant the CPU can execute that fails to build fails the test under CI
(``CI=true``): CI must build and test the kernels of the machine it runs on.
"""

from __future__ import annotations

import os

import pytest
import torch

from tokenbudget.kernels.cpu import native
from tokenbudget.kernels.cpu import quant_gemm as cg

VARIANTS = [v.name for v in native.VARIANTS]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def use_variant(name: str, monkeypatch):
    """Select ``name`` for the test (``TOKENBUDGET_NATIVE``) and return its loaded library."""
    lacks = native.missing(name)
    if lacks:
        pytest.skip(f"CPU lacks {', '.join(lacks)} (C kernel variant {name})")
    lib = native.load(name)
    if lib is None:
        why = f"C kernel variant {name} failed to build: {native.build_error(name)}"
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)
    monkeypatch.setenv(native.ENV, name)
    return lib


def q4_weight(w: torch.Tensor) -> cg.Q4Weight:
    """``w [N, K]`` as GGUF Q4_1 codes (groups of 32, min/max scaling) for the C GEMMs."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).clamp(min=1e-12)
    return cg.Q4Weight.from_codes(torch.round((g - lo[..., None]) / d[..., None]).clamp(0, 15).reshape(n, k), d, lo)


def q8_weight(w: torch.Tensor) -> cg.Q8Weight:
    """``w [N, K]`` as symmetric per-channel int8 codes for the C GEMMs."""
    s = w.abs().amax(1) / 127
    return cg.Q8Weight.from_codes(torch.round(w / s[:, None]).clamp(-127, 127), s)
