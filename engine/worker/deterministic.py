"""Deterministic (batch-invariant) mode on CUDA: ``EngineConfig(deterministic=True)``.

Goal: a position's logits are the same bits whether it is decoded alone, verified inside a
(1 + k)-row verify or computed next to other requests, so greedy speculation is bit-identical
to plain decoding (the CPU path already is: oneDNN prepacked linears on padded rows and the
torch_ref attention, see ``engine/model/decoder.py``). On CUDA that needs:

* attention: every decode/verify row through tensor-core decode with ``q_len_per_req`` and no
  KV split (the FlashInfer backend always does this), and prefill chunks with
  ``disable_split_kv=True`` (``FlashInferBackend(deterministic=True)``, passed by the selector);
* RMSNorm: ``kernels/rmsnorm_triton.py`` (one program per row, one fixed-width reduction)
  instead of torch's CUDA reduction, whose launch shape depends on the row count;
* GEMMs: the batch-invariant Triton matmul (``kernels/batch_invariant_matmul.py``; one tiling
  for every M) instead of cuBLAS, whose kernel choice depends on M;
* no process-wide switches: every GEMM of the target's forward and logits goes through the
  Triton matmul, so no cuBLAS call is left whose flags (``torch.backends.cuda.matmul``
  reduced-precision reductions, TF32) would matter; flipping them would change every other
  model in the process and was never undone;
* fp32 logits (always: ``Linear.fp32_out``).

Cost: no split-KV (long contexts at small batch use fewer SMs) and no cuBLAS for the linears;
both are GPU measurements owed (``benches/gpu_check.py`` reports them).
"""

from __future__ import annotations

import logging

import torch

from tokenbudget.kernels.triton_utils import triton_runnable_on

logger = logging.getLogger(__name__)


def apply_deterministic_mode(model, device: torch.device | str) -> bool:
    """Switch ``model``'s linears to the batch-invariant matmul where Triton runs on ``device``
    (CUDA; CPU only under ``TRITON_INTERPRET=1``, for tests). Returns whether it did."""
    device = torch.device(device)
    if not triton_runnable_on(device):
        if device.type == "cuda":
            raise ValueError("deterministic=True on CUDA needs triton (the batch-invariant matmul)")
        return False  # CPU: already batch-invariant without Triton
    from tokenbudget.kernels.rmsnorm_triton import rms_norm_batch_invariant
    model.rms_norm = rms_norm_batch_invariant
    linears = [model.lm_head]

    def invariant(lin):
        lin.invariant = True
        linears.append(lin)
        return lin
    for lw in model.layers:
        lw.map_linears(invariant)
    model.lm_head.invariant = True
    logger.info("deterministic mode: batch-invariant matmul for %d linears and RMSNorm on %s", len(linears), device)
    return True


__all__ = ["apply_deterministic_mode"]
