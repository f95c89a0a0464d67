"""Slot-mapping K/V write into a paged KV cache: a torch reference and a Triton kernel.

Contract (shared by :func:`write_kv_reference`, :func:`write_kv_triton` and
:func:`write_kv`):

* ``k``, ``v``: ``[T, num_kv_heads, head_dim]``, any strides (e.g. views into a fused
  QKV projection output).
* ``kv_cache``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (FlashInfer's
  NHD combined layout; ``kv_cache[:, 0]`` holds K, ``kv_cache[:, 1]`` holds V). Any
  strides; written in place.
* ``slot_mapping``: ``[T]`` int32/int64 on the same device; token ``t`` goes to block
  ``slot // block_size`` at offset ``slot % block_size``. ``slot == -1`` (any negative
  value) means padding: nothing is written for that token.
* Valid slots must be distinct and ``< num_blocks * block_size``; duplicates give an
  unspecified winner (not checked: it would cost a sync on the hot path).
* ``k``, ``v`` and ``kv_cache`` share one dtype (a ``ValueError`` otherwise). No cast on
  write: Triton's CPU interpreter truncates fp32->bf16 where CUDA rounds to nearest even,
  so a cast could not be tested bitwise here; quantised (fp8) caches need scales anyway
  and belong in their own kernel.
"""

from __future__ import annotations

import functools

import torch

from tokenbudget.kernels.triton_utils import next_power_of_2, triton_runnable_on


def _check_args(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    if k.dim() != 3:
        raise ValueError(f"k must be [T, num_kv_heads, head_dim], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}")
    if tuple(kv_cache.shape[3:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"kv_cache heads/head_dim {tuple(kv_cache.shape[3:])} != k {tuple(k.shape[1:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping must be [T={k.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    for name, t in (("v", v), ("kv_cache", kv_cache)):
        if t.dtype != k.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != k dtype {k.dtype}")
    for name, t in (("v", v), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k is on {k.device}")


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Torch reference: ``kv_cache[slot // P, {0,1}, slot % P] = {k, v}`` via index_put."""
    _check_args(k, v, kv_cache, slot_mapping)
    block_size = kv_cache.shape[2]
    slots = slot_mapping.long()
    valid = slots >= 0
    slots = slots[valid]
    blk = torch.div(slots, block_size, rounding_mode="floor")
    off = slots % block_size
    kv_cache[blk, 0, off] = k[valid]
    kv_cache[blk, 1, off] = v[valid]


@functools.cache
def _kernel():
    """Build the Triton kernel on first use (imports triton; honours TRITON_INTERPRET)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, cache_ptr, slot_ptr,
        k_st, k_sh, k_sd,
        v_st, v_sh, v_sd,
        c_sb, c_skv, c_so, c_sh, c_sd,
        block_size, head_dim,
        BLOCK_D: tl.constexpr,
    ):
        # One program per (token, kv head): copies head_dim elements of K and of V.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        keep = slot >= 0
        slot = tl.where(keep, slot, 0)  # keep addresses in range for padded tokens
        blk = slot // block_size
        off = slot % block_size
        d = tl.arange(0, BLOCK_D).to(tl.int64)
        # `d < (keep ? head_dim : 0)`, not `(d < head_dim) & keep`: the triton 3.9 interpreter
        # rejects a block mask combined with a scalar bool.
        m = d < tl.where(keep, head_dim, 0)
        kx = tl.load(k_ptr + t * k_st + h * k_sh + d * k_sd, mask=m)
        vx = tl.load(v_ptr + t * v_st + h * v_sh + d * v_sd, mask=m)
        dst = cache_ptr + blk * c_sb + off * c_so + h * c_sh + d * c_sd
        tl.store(dst, kx, mask=m)
        tl.store(dst + c_skv, vx, mask=m)

    return _write_kv_kernel


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Triton kernel with the same contract as :func:`write_kv_reference`.

    Launches a ``(T, num_kv_heads)`` grid; no host sync. Requires
    :func:`kernels.triton_utils.triton_runnable_on` for ``k.device``.
    """
    _check_args(k, v, kv_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if not triton_runnable_on(k.device):
        raise RuntimeError(
            f"Triton cannot run on {k.device} (need CUDA, or TRITON_INTERPRET=1 for CPU)")
    _kernel()[(num_tokens, num_heads)](
        k, v, kv_cache, slot_mapping,
        *k.stride(), *v.stride(), *kv_cache.stride(),
        kv_cache.shape[2], head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        # a program copies one head: <= 128 elements per row on every supported model, so one
        # warp (4 elements a thread) instead of Triton's default 4 warps, 3 of them idle
        num_warps=max(1, min(4, next_power_of_2(head_dim) // 128)),
    )


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Dispatch: the Triton kernel on CUDA when triton is installed, else the reference.

    On CPU the reference is used even under ``TRITON_INTERPRET=1``: the interpreter
    is for testing the kernel, not for serving.
    """
    if k.device.type == "cuda" and triton_runnable_on(k.device):
        write_kv_triton(k, v, kv_cache, slot_mapping)
    else:
        write_kv_reference(k, v, kv_cache, slot_mapping)


__all__ = ["write_kv", "write_kv_reference", "write_kv_triton"]
