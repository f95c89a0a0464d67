"""Attention-backend interface shared by the model code and the model runner.

One step = one flat token batch of ``T`` tokens from ``B`` requests, in request order:
request ``b`` owns query rows ``qo_indptr[b]:qo_indptr[b+1]`` (a prefill chunk, a 1-token
decode or a (1 + k)-token verify; all may share a batch). ``kv_lens[b]`` counts the request's
context INCLUDING its new tokens, so the new tokens sit at positions
``kv_lens[b] - q_len .. kv_lens[b] - 1`` and causal masking is bottom-right aligned.

The backend builds an :class:`AttentionMetadata` once per step (``build_metadata``; host work,
shared by every layer), then each layer calls ``write_kv`` (new K/V -> paged cache through
``slot_mapping``) and ``attend`` (queries against the whole paged context).

KV cache per layer: ONE tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(FlashInfer's combined NHD layout: ``[:, 0]`` holds K, ``[:, 1]`` holds V), so a FlashInfer
backend uses the very same tensors.

The token batch may be padded past the real tokens (``num_tokens`` real rows, then padding
rows, see ``engine.model.decoder``): padding rows are never written to the cache and their
attention output is zero.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Static shape facts a backend needs (FlashInfer's ``plan`` needs them per step)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32
    scale: float | None = None  # None = head_dim ** -0.5
    # scores -> cap * tanh(scores / cap) after the scale, before the mask (Gemma 2); None: none
    logits_soft_cap: float | None = None
    # the sliding windows some layers attend with (``attend(..., window=w)``), so a backend that
    # plans per step can plan each once; a window w: a query sees its last w keys, itself included
    sliding_windows: tuple[int, ...] = ()
    sinks: bool = False  # layers pass per-head sink logits to ``attend`` (gpt-oss)

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, got {self.logits_soft_cap!r}")
        if any(w <= 0 for w in self.sliding_windows):
            raise ValueError(f"sliding_windows must be positive, got {self.sliding_windows!r}")

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step facts, built once by :meth:`AttentionBackend.build_metadata`.

    Host lists are the source of truth; tensors live on the model's device. ``backend_data``
    is private to the backend that built it (e.g. a FlashInfer wrapper after ``plan``).
    """

    qo_indptr: list[int]          # [B + 1]
    kv_lens: list[int]            # [B]
    block_tables: list[list[int]]  # [B][num blocks of the request]
    slot_mapping: torch.Tensor    # [num_tokens] int64, flat slot per real new token
    num_tokens: int               # real tokens (rows past this are padding)
    backend_data: Any = None      # private to the backend that built it
    backend: AttentionBackend | None = None  # the builder; layers call its write_kv/attend

    @property
    def num_reqs(self) -> int:
        return len(self.kv_lens)


class AttentionBackend(ABC):
    """Builds per-step metadata, writes new K/V, attends. Stateless across steps."""

    name: str = "abstract"

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)

    @abstractmethod
    def build_metadata(self, qo_indptr: list[int], kv_lens: list[int],
                       block_tables: list[list[int]], slot_mapping: torch.Tensor) -> AttentionMetadata:
        """``qo_indptr[B+1]``, ``kv_lens[B]`` (context incl. new tokens), block tables and
        ``slot_mapping[T]`` (``block_id * block_size + offset`` per new token)."""

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        """Store ``k``, ``v`` (``[>= num_tokens, num_kv_heads, head_dim]``; rows past
        ``num_tokens`` are padding and are ignored) into ``kv_cache`` in place."""

    def align_tiles(self, max_q_len: int) -> None:
        """The engine's longest decode/verify is ``max_q_len`` rows per request. A backend whose
        arithmetic for a row depends on how many rows its request has (FlashInfer's tile) plans
        so that it does not, up to this length; the others need nothing."""
        return None

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q [Tp, num_heads, head_dim]`` -> ``out [Tp, num_heads, head_dim]`` (padding rows 0).
        Must be called after ``write_kv`` of the same layer (the context includes the new tokens).
        ``window`` > 0 (one of ``spec.sliding_windows``): the query at position i sees keys
        ``i - window + 1 .. i`` only (a sliding-window layer); 0: its whole context. ``sinks``
        (``[num_heads]`` fp32, with ``spec.sinks``): a logit per head that joins each softmax's
        denominator and attends to nothing (gpt-oss's attention sinks)."""


def check_metadata_inputs(qo_indptr: list[int], kv_lens: list[int],
                          block_tables: list[list[int]], block_size: int) -> None:
    """Cheap host-side validation (one pass over B requests)."""
    if len(qo_indptr) != len(kv_lens) + 1 or len(block_tables) != len(kv_lens):
        raise ValueError(f"qo_indptr has {len(qo_indptr)} entries, kv_lens {len(kv_lens)}, "
                         f"block_tables {len(block_tables)}: need B+1, B, B")
    for b, kv_len in enumerate(kv_lens):
        q_len = qo_indptr[b + 1] - qo_indptr[b]
        if q_len < 1 or q_len > kv_len:
            raise ValueError(f"request {b}: q_len {q_len} must be in [1, kv_len={kv_len}]")
        if len(block_tables[b]) * block_size < kv_len:
            raise ValueError(f"request {b}: {len(block_tables[b])} blocks of {block_size} "
                             f"cannot hold kv_len {kv_len}")
