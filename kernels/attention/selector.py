"""Pick the attention backend for a device and log which one is active (one line).

CPU: :class:`~kernels.attention.torch_ref.TorchRefBackend`. CUDA:
``kernels.attention.flashinfer_backend.FlashInferBackend`` unless FlashInfer refuses, and then
the reference with the reason in the log line, never a start-up crash: a float32 KV cache,
``head_dim`` < 64, ``flashinfer`` not installed or failing to import (a missing CUDA library,
a JIT/toolchain mismatch). ``TOKENBUDGET_ATTENTION_BACKEND=torch_ref`` forces the reference;
``TOKENBUDGET_ATTENTION_BACKEND=flashinfer`` turns that fallback into a ``ValueError`` (what
``benches/gpu_check.py --device cuda`` sets: a check that silently ran torch_ref proves nothing).
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


def _flashinfer_refusal(spec: AttentionSpec, device: torch.device) -> str:
    """Why FlashInfer cannot serve this spec here ("" when it can); imports it to find out."""
    from tokenbudget.kernels.attention.flashinfer_plan import flashinfer_refusal
    why = flashinfer_refusal(spec, device)
    if why:
        return why
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    try:
        importlib.import_module("flashinfer")
    except Exception as e:  # noqa: BLE001 - any import failure means: use the reference
        return f"import flashinfer failed: {type(e).__name__}: {e}"
    return ""


def select_attention_backend(device: torch.device | str, spec: AttentionSpec, *,
                             deterministic: bool = False, attends_itself: str = "") -> AttentionBackend:
    """``attends_itself``: the name of a model forward that runs its own attention (the C decoder
    forward on the CPU), said in the log line: the backend then only serves the steps it leaves."""
    device = torch.device(device)
    forced = os.environ.get("TOKENBUDGET_ATTENTION_BACKEND", "")
    why = "CPU"
    if forced == "torch_ref":
        why = "forced by TOKENBUDGET_ATTENTION_BACKEND"
    elif forced not in ("", "flashinfer"):
        raise ValueError(f"TOKENBUDGET_ATTENTION_BACKEND={forced!r}: expected torch_ref or flashinfer")
    elif device.type == "cuda" or forced == "flashinfer":
        why = _flashinfer_refusal(spec, device)
        if not why:
            from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend
            backend = FlashInferBackend(spec, device, deterministic=deterministic)
            logger.info("attention backend: flashinfer on %s%s", device,
                        " (deterministic)" if deterministic else "")
            return backend
        why = f"flashinfer refused: {why}"
        if forced == "flashinfer":
            raise ValueError(f"TOKENBUDGET_ATTENTION_BACKEND=flashinfer but {why}")
    backend = TorchRefBackend(spec, device)
    if attends_itself:
        logger.info("attention: %s on %s (%s only for the steps it does not take)", attends_itself, device,
                    backend.name)
        return backend
    logger.info("attention backend: %s on %s (%s)", backend.name, device, why)
    return backend
