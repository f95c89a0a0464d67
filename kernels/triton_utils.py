"""Guards for optional Triton kernels.

Triton is optional: the CPU torch wheel ships without it, and importing it costs
seconds. So nothing here imports ``triton`` at module import time. Kernel modules
define their ``@triton.jit`` functions inside a cached factory that imports triton
on first use (see ``kernels/kv_write.py``), and dispatch through
:func:`triton_runnable_on` to pick the Triton kernel or its torch reference.

Where a Triton kernel can run:

* on a CUDA tensor, when ``triton`` is installed (the normal GPU path);
* on a CPU tensor, only under Triton's interpreter (``TRITON_INTERPRET=1``).
  The interpreter reads that variable when a kernel is *decorated*, so it must be
  set before the kernel factory first runs - in practice before the process starts.
  The tests run interpreter checks in a subprocess for this reason.

``HAS_TRITON`` is decided once, from ``importlib.util.find_spec`` (no import).
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON: bool = importlib.util.find_spec("triton") is not None

_TRUE = ("1", "true", "yes", "on", "y")


def triton_interpret_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value (read each call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def triton_runnable_on(device: torch.device | str) -> bool:
    """Whether a Triton kernel can be launched on tensors living on ``device``."""
    if not HAS_TRITON:
        return False
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available()
    if dev.type == "cpu":
        return triton_interpret_enabled()
    return False


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1); Triton block sizes must be powers of two."""
    if n < 1:
        return 1
    return 1 << (n - 1).bit_length()


__all__ = [
    "HAS_TRITON",
    "next_power_of_2",
    "triton_interpret_enabled",
    "triton_runnable_on",
]
