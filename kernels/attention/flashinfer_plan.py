"""FlashInfer's host-side planning facts, without FlashInfer: when it can serve a layout, the CSR
page table ``plan()`` takes, its CTA tile rule and the tile floor that puts a request's decodes and
verifies on one tile, and the workspace a plan may need. Imported by the backend
(``flashinfer_backend.py``), the selector and the CUDA-graph runner; importable without flashinfer
or CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbudget.kernels.attention.base import AttentionSpec

MIN_HEAD_DIM = 64  # below this the review found FlashInfer 0.6.18 refusing (not yet seen on a GPU)


def flashinfer_refusal(spec: AttentionSpec, device: torch.device) -> str:
    """Why the real FlashInfer cannot serve ``spec`` on ``device`` ("" when it can)."""
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return f"needs a float16/bfloat16 KV cache, got {spec.dtype}"
    if spec.head_dim < MIN_HEAD_DIM:
        return f"head_dim {spec.head_dim} < {MIN_HEAD_DIM}"
    if spec.sliding_windows or spec.logits_soft_cap is not None:
        return "sliding-window layers and logit soft-capping are not planned on FlashInfer yet"
    if spec.sinks:
        return "attention sinks are not planned on FlashInfer yet"
    return ""


@dataclass(slots=True)
class PageTable:
    """CSR page table (host int32 tensors) as FlashInfer's ``plan()`` takes it."""

    qo_indptr: torch.Tensor        # [B + 1]
    kv_indptr: torch.Tensor        # [B + 1]
    kv_indices: torch.Tensor       # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [B], 1..block_size


def build_page_table(qo_indptr: list[int], kv_lens: list[int], block_tables: list[list[int]],
                     block_size: int) -> PageTable:
    """Host-side CSR build, one pass over the B requests."""
    kv_indptr, indices, last = [0], [], []
    for kv_len, table in zip(kv_lens, block_tables):
        n = -(-kv_len // block_size)
        indices.extend(table[:n])
        kv_indptr.append(kv_indptr[-1] + n)
        last.append(kv_len - (n - 1) * block_size)
    i32 = torch.int32
    return PageTable(torch.tensor(qo_indptr, dtype=i32), torch.tensor(kv_indptr, dtype=i32),
                     torch.tensor(indices, dtype=i32), torch.tensor(last, dtype=i32))


UNIFORM_MAX_Q_LEN = 16  # q_len up to this runs through tensor-core decode (q_len_per_req)
# Deterministic mode aligns every uniform request's tile to this L's (whatever the engine's k).
DETERMINISTIC_Q_LEN = UNIFORM_MAX_Q_LEN


def cta_tile_rows(packed_rows: int, head_dim: int) -> int:
    """FlashInfer's CTA tile (``FA2DetermineCtaTileQ``, sm_80+) for a uniform group of
    ``q_len * G`` packed query rows: 16 rows up to 16, 64 up to 64, else 128 (64 from head_dim 256)."""
    if packed_rows > 64 and head_dim < 256:
        return 128
    return 64 if packed_rows > 16 else 16


def tile_floor(max_q_len: int, group_size: int, head_dim: int) -> int:
    """The smallest L whose tile is the tile of ``max_q_len`` rows (G = ``group_size`` query heads
    per kv head): planning every uniform request with at least this many rows puts decodes and
    verifies up to ``max_q_len`` rows on one tile."""
    target = cta_tile_rows(max_q_len * group_size, head_dim)
    return next(q for q in range(1, max_q_len + 1) if cta_tile_rows(q * group_size, head_dim) == target)


def eager_workspace_bytes(spec: AttentionSpec, num_sms: int) -> int:
    """Split-KV scratch the largest eager prefill plan can reserve (scheduler.cuh, PrefillPlan):
    FlashInfer splits only when the split batch fits ``2 * num_sms / num_kv_heads`` work tiles,
    each of at most 128 rows: ``tmp_v`` (head_dim floats per row and head) plus ``tmp_s``."""
    tiles = 2 * num_sms // spec.num_kv_heads
    return spec.num_heads * tiles * 128 * (spec.head_dim + 1) * 4 + (1 << 20)


__all__ = ["DETERMINISTIC_Q_LEN", "MIN_HEAD_DIM", "UNIFORM_MAX_Q_LEN", "PageTable", "build_page_table",
           "cta_tile_rows", "eager_workspace_bytes", "flashinfer_refusal", "tile_floor"]
