"""Triton rejection sampler, bit-identical to ``kernels.rejection_ref.rejection_sample_reference``.

Same arguments, same output; see the reference's module docstring for the rule. One Triton
program per request:

1. acceptance walk over the request's k_i drafts (greedy: draft == target argmax; random:
   ``u * q(x) < p(x)`` in float32), counting the accepted prefix and writing accepted drafts;
2. the emitted token at position e = num_accepted: greedy requests read ``target_argmax``;
   random requests run the exponential race over the vocabulary in ``BLOCK_V`` tiles, keeping
   two running argmaxes in one pass - over ``w = max(p_e - q_e, 0)`` and over ``p_e`` - and pick
   the second when every ``w`` is zero (the reference's ``p == q`` fallback).

Bitwise agreement rests on: the same float32 operations in the same order (``u * q < p``,
``clamp_min(p - q, 0)``, ``w / noise`` done with ``tl.math.div_rn`` - Triton's default ``/`` is
an approximate division on NVIDIA GPUs); ties going to the lowest index (``tl.argmax`` breaks
ties left inside a tile, and a later tile only wins when strictly greater); padding lanes scored
-2, below the reference's -1 for zero-weight tokens. Row offsets are cast to int64 before being
multiplied by the vocabulary size.

Output columns: ``max_k + 1``; ``max_k = int(num_draft_tokens.max())`` costs a device sync, so
callers that know it (the sampler, from the step's drafts on the host) pass ``max_num_draft_tokens``.
"""

from __future__ import annotations

import functools

import torch

from tokenbudget.kernels.rejection_ref import (
    PLACEHOLDER_TOKEN_ID,
    rejection_sample_reference,
    request_offsets,
)
from tokenbudget.kernels.triton_utils import triton_runnable_on

DEFAULT_BLOCK_V = 1024


@functools.cache
def _kernel():
    """Build the Triton kernel on first use (imports triton; honours TRITON_INTERPRET)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rejection_kernel(
        out_ptr, target_probs_ptr, target_argmax_ptr, draft_ids_ptr, num_drafts_ptr,
        row_starts_ptr, draft_starts_ptr, draft_probs_ptr, is_greedy_ptr, uniforms_ptr,
        exp_noise_ptr, vocab_size, out_stride,
        ALL_GREEDY: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        req = tl.program_id(0).to(tl.int64)
        k = tl.load(num_drafts_ptr + req).to(tl.int64)
        row0 = tl.load(row_starts_ptr + req).to(tl.int64)
        d0 = tl.load(draft_starts_ptr + req).to(tl.int64)
        rnd = tl.load(is_greedy_ptr + req) == 0  # a random (non-greedy) request
        out_row = out_ptr + req * out_stride

        # 1. acceptance walk: alive stays 1 while every earlier draft was accepted.
        num_acc = tl.zeros((), dtype=tl.int64)
        alive = tl.full((), 1, dtype=tl.int64)
        # Loops are `while` loops over scalar tensors, not `for ... in range(runtime)`: the
        # triton 3.6 interpreter turns a runtime bound into a 1-element array that numpy >= 2.3
        # refuses to convert to an index. Compiled code is the same scf loop either way.
        j = tl.zeros((), dtype=tl.int64)
        while (j < k) & (alive != 0):
            x = tl.load(draft_ids_ptr + d0 + j).to(tl.int64)
            acc = (tl.load(target_argmax_ptr + row0 + j).to(tl.int64) == x) & (rnd == 0)
            if not ALL_GREEDY:
                p_x = tl.load(target_probs_ptr + (row0 + j) * vocab_size + x, mask=rnd, other=0.0)
                if HAS_DRAFT_PROBS:
                    q_x = tl.load(draft_probs_ptr + (d0 + j) * vocab_size + x, mask=rnd, other=1.0)
                else:
                    q_x = 1.0
                u = tl.load(uniforms_ptr + d0 + j, mask=rnd, other=1.0)
                acc = tl.where(rnd, u * q_x < p_x, acc)
            alive = acc.to(tl.int64)
            num_acc += alive
            tl.store(out_row + j, x, mask=alive != 0)
            j += 1

        # 2. emitted token at position e = num_acc (row row0 + e).
        row = (row0 + num_acc).to(tl.int64)
        tok = tl.load(target_argmax_ptr + row).to(tl.int64)
        if not ALL_GREEDY:
            if rnd:
                rejected = num_acc < k
                x_e = tl.load(draft_ids_ptr + d0 + num_acc, mask=rejected, other=-1).to(tl.int64)
                best_w = tl.full((), -3.0, dtype=tl.float32)
                best_p = tl.full((), -3.0, dtype=tl.float32)
                idx_w = tl.zeros((), dtype=tl.int64)
                idx_p = tl.zeros((), dtype=tl.int64)
                any_w = tl.zeros((), dtype=tl.int32)
                v0 = tl.zeros((), dtype=tl.int64)
                while v0 < vocab_size:
                    v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
                    vm = v < vocab_size
                    p = tl.load(target_probs_ptr + row * vocab_size + v, mask=vm, other=0.0)
                    noise = tl.load(exp_noise_ptr + req * vocab_size + v, mask=vm, other=1.0)
                    if HAS_DRAFT_PROBS:
                        # mask `v < (rejected ? V : 0)`: the triton 3.9 interpreter rejects a
                        # block mask combined with a scalar bool
                        q = tl.load(draft_probs_ptr + (d0 + num_acc) * vocab_size + v,
                                    mask=v < tl.where(rejected, vocab_size, 0), other=0.0)
                    else:
                        q = tl.where(v == x_e, 1.0, 0.0)  # x_e == -1 unless rejected
                    w = tl.maximum(p - q, 0.0)
                    any_w = any_w | tl.max(((w > 0) & vm).to(tl.int32), 0)
                    s_w = tl.where(w > 0, tl.math.div_rn(w, noise), -1.0)
                    s_w = tl.where(vm, s_w, -2.0)
                    s_p = tl.where(p > 0, tl.math.div_rn(p, noise), -1.0)
                    s_p = tl.where(vm, s_p, -2.0)
                    m_w, i_w = tl.max(s_w, 0, return_indices=True)
                    m_p, i_p = tl.max(s_p, 0, return_indices=True)
                    idx_w = tl.where(m_w > best_w, v0 + i_w.to(tl.int64), idx_w)
                    best_w = tl.maximum(best_w, m_w)
                    idx_p = tl.where(m_p > best_p, v0 + i_p.to(tl.int64), idx_p)
                    best_p = tl.maximum(best_p, m_p)
                    v0 += BLOCK_V
                tok = tl.where(any_w != 0, idx_w, idx_p)
        tl.store(out_row + num_acc, tok)

    return _rejection_kernel


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Never read; a real allocation so the launcher sees a valid pointer.
    return torch.zeros(1, dtype=dtype, device=device)


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    return t if t.numel() else _dummy(t.device, t.dtype)


def rejection_sample_triton(
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
    exp_noise: torch.Tensor | None,
    *,
    max_num_draft_tokens: int | None = None,
    block_v: int = DEFAULT_BLOCK_V,
) -> torch.Tensor:
    """Triton twin of ``rejection_sample_reference`` (same arguments and output)."""
    device = target_argmax.device
    if not triton_runnable_on(device):
        raise RuntimeError(
            f"Triton cannot run on {device} (need CUDA, or TRITON_INTERPRET=1 for CPU)")
    k = num_draft_tokens.to(torch.int64)
    num_reqs = k.numel()
    max_k = int(k.max()) if max_num_draft_tokens is None and num_reqs else (max_num_draft_tokens or 0)
    out = torch.full((num_reqs, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return out
    all_greedy = target_probs is None
    if not all_greedy and exp_noise is None:
        if not bool(is_greedy.all()):  # reference asserts here too
            raise ValueError("exp_noise is required for random (non-greedy) requests")
        all_greedy = True
    if not all_greedy:
        if target_probs.dtype != torch.float32 or target_probs.dim() != 2:
            raise ValueError(f"target_probs must be [T, V] float32, got "
                             f"{target_probs.dtype} {tuple(target_probs.shape)}")
        if draft_probs is not None and draft_probs.dtype != torch.float32:
            raise ValueError(f"draft_probs must be float32, got {draft_probs.dtype}")
    vocab_size = target_probs.shape[1] if not all_greedy else 1
    row_starts, draft_starts = request_offsets(k)
    f32 = _dummy(device, torch.float32)
    _kernel()[(num_reqs,)](
        out,
        f32 if all_greedy else target_probs.contiguous(),
        target_argmax.contiguous(),
        _nonempty(draft_token_ids.contiguous()),
        k, row_starts, draft_starts,
        _nonempty(draft_probs.contiguous()) if draft_probs is not None else f32,
        is_greedy.to(torch.int32),
        _nonempty(uniforms.to(torch.float32).contiguous()),
        f32 if all_greedy else exp_noise.to(torch.float32).contiguous(),
        vocab_size, max_k + 1,
        ALL_GREEDY=all_greedy, HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_V=block_v,
    )
    return out


def rejection_sample(*args, max_num_draft_tokens: int | None = None, **kwargs) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA when triton is installed, else the torch reference."""
    argmax = kwargs.get("target_argmax", args[1] if len(args) > 1 else None)
    if argmax is not None and argmax.device.type == "cuda" and triton_runnable_on(argmax.device):
        return rejection_sample_triton(*args, max_num_draft_tokens=max_num_draft_tokens, **kwargs)
    return rejection_sample_reference(*args, **kwargs)


__all__ = ["rejection_sample", "rejection_sample_triton"]
