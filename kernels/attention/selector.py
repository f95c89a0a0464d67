"""Pick the attention backend for a device and log which one is active (one line).

CPU (or CUDA without FlashInfer): :class:`~kernels.attention.torch_ref.TorchRefBackend`.
CUDA with ``flashinfer`` importable: ``kernels.attention.flashinfer_backend.FlashInferBackend``
when that module exists (registered by a colleague; it must subclass ``AttentionBackend`` and
take ``(spec, device)``). ``TOKENBUDGET_ATTENTION_BACKEND=torch_ref`` forces the reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os

import torch

from tokenbudget.kernels.attention.base import AttentionBackend, AttentionSpec
from tokenbudget.kernels.attention.torch_ref import TorchRefBackend

logger = logging.getLogger(__name__)


def _flashinfer_backend_cls():
    if importlib.util.find_spec("flashinfer") is None:
        return None, "flashinfer is not installed"
    try:
        mod = importlib.import_module("tokenbudget.kernels.attention.flashinfer_backend")
    except ImportError as e:  # module not written yet, or flashinfer fails to import
        return None, f"flashinfer backend unavailable ({e})"
    return getattr(mod, "FlashInferBackend"), ""


def select_attention_backend(device: torch.device | str, spec: AttentionSpec) -> AttentionBackend:
    device = torch.device(device)
    forced = os.environ.get("TOKENBUDGET_ATTENTION_BACKEND", "")
    cls, why = TorchRefBackend, "CPU"
    if device.type == "cuda" and forced != "torch_ref":
        fi_cls, why = _flashinfer_backend_cls()
        cls = fi_cls or TorchRefBackend
    elif forced == "torch_ref":
        why = "forced by TOKENBUDGET_ATTENTION_BACKEND"
    backend = cls(spec, device)
    logger.info("attention backend: %s on %s%s", backend.name, device, f" ({why})" if why else "")
    return backend
