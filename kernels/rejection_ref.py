"""Reference (torch) rejection sampler: the verification rule as a pure tensor function.

Plain sampling is verification with zero drafts, so this single function serves both; the
``engine.sampler.Sampler`` prepares its inputs (processed target probabilities, argmaxes, drafted
tokens, pre-drawn random numbers) and calls it once per step. A Triton kernel must reproduce
``rejection_sample_reference`` bit for bit on the same inputs; every random number is an explicit
input, so the output is a deterministic function of the arguments.

Layout (B requests, request i has k_i >= 0 drafts, D = sum k_i, T = D + B target rows)
-----------------------------------------------------------------------------------------
Request i owns the 1 + k_i consecutive target rows ``[s_i, s_i + k_i]`` with
``s_i = sum_{j<i} (k_j + 1)``; row ``s_i + j`` is the target's distribution for the slot of draft
j (j < k_i), row ``s_i + k_i`` is the bonus slot. Request i's drafts are the flat entries
``[d_i, d_i + k_i)`` with ``d_i = sum_{j<i} k_j``.

The rule, per request (positions j = 0, 1, ...; x_j = draft j; p_j = target_probs[s_i + j])
-----------------------------------------------------------------------------------------
Greedy request (``is_greedy[i]``): draft j is accepted iff ``x_j == target_argmax[s_i + j]`` and
all earlier drafts were accepted. The emitted token at the first non-accepted position e (e = k_i
when all are accepted) is ``target_argmax[s_i + e]``. ``target_probs``, ``draft_probs``,
``uniforms`` and ``exp_noise`` are not read for greedy requests.

Random request: with ``q_j = draft_probs[d_i + j, x_j]`` (or ``q_j = 1`` when ``draft_probs`` is
None), draft j is accepted iff ``uniforms[d_i + j] * q_j < p_j[x_j]`` (float32 arithmetic; this is
``u < min(1, p/q)`` for u in [0, 1), and a token with ``p_j[x_j] == 0`` is never accepted).
Let e be the first rejected position (e = k_i when all are accepted). The emitted token is

    argmax_v  score(v),   score(v) = w(v) / exp_noise[i, v]  if w(v) > 0  else -1

with ties going to the lowest index, where the weights are

    rejection (e < k_i):  w = max(p_e - q_e, 0)   with q_e = draft_probs[d_i + e]
                           (q_e = one_hot(x_e) when draft_probs is None, i.e. p_e with x_e zeroed);
                           if every w(v) == 0 (p_e == q_e), w = p_e instead;
    bonus (e == k_i):     w = p_e.

For ``exp_noise ~ Exp(1)`` i.i.d. this is an exact sample from normalize(w) (the exponential
race); a zero noise entry gives ``+inf`` for a token with w > 0, never for a token with w == 0, so
a token of zero target probability is never emitted. One noise vector per request suffices: only
one position's recovered/bonus sample is ever used, and which one depends only on the uniforms.
The division is float32 ``w / noise``; ``max(p - q, 0)`` is float32 ``clamp_min(p - q, 0)``.

Output: ``[B, max_k + 1]`` int64, row i = accepted drafts, then the emitted token, then
``PLACEHOLDER_TOKEN_ID`` (-1) padding; request i emitted ``num_accepted_i + 1`` tokens.
"""

from __future__ import annotations

import torch

__all__ = ["PLACEHOLDER_TOKEN_ID", "rejection_sample_reference", "num_emitted", "request_offsets"]

PLACEHOLDER_TOKEN_ID = -1


def request_offsets(num_draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(target-row starts s_i, flat draft starts d_i) for per-request draft counts k_i ([B] int64)."""
    k = num_draft_tokens.to(torch.int64)
    draft_starts = torch.cumsum(k, 0) - k
    row_starts = draft_starts + torch.arange(k.numel(), device=k.device)
    return row_starts, draft_starts


def _padded_drafts(
    draft_token_ids: torch.Tensor, k: torch.Tensor, draft_starts: torch.Tensor, max_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, max_k] flat draft index, draft id (placeholder-padded) and validity mask."""
    pos = torch.arange(max_k, device=k.device)
    valid = pos[None, :] < k[:, None]
    flat_idx = torch.where(valid, draft_starts[:, None] + pos[None, :], 0)
    ids = torch.where(valid, draft_token_ids[flat_idx] if draft_token_ids.numel() else flat_idx, PLACEHOLDER_TOKEN_ID)
    return flat_idx, ids, valid


def _accept_mask(
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
    ids: torch.Tensor,
    flat_idx: torch.Tensor,
    valid: torch.Tensor,
    row_starts: torch.Tensor,
) -> torch.Tensor:
    """[B, max_k] bool: draft j of request i passes its own test (before the prefix rule)."""
    max_k = ids.shape[1]
    rows = row_starts[:, None] + torch.arange(max_k, device=ids.device)[None, :]
    rows = torch.where(valid, rows, 0)
    safe_ids = ids.clamp_min(0)
    accept = (target_argmax[rows] == ids) & is_greedy[:, None]
    if target_probs is not None and bool((~is_greedy).any()):
        p_x = target_probs[rows, safe_ids]
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
        else:
            q_x = draft_probs[flat_idx, safe_ids]
        u = uniforms.to(torch.float32)[flat_idx] if uniforms.numel() else torch.zeros_like(p_x)
        accept = torch.where(is_greedy[:, None], accept, u * q_x < p_x)
    return accept & valid


def _emit_random(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    exp_noise: torch.Tensor,
    ids: torch.Tensor,
    flat_idx: torch.Tensor,
    emit_rows: torch.Tensor,
    emit_pos: torch.Tensor,
    rejected: torch.Tensor,
) -> torch.Tensor:
    """[B] recovered (rejected) or bonus token for every request, by the exponential race."""
    p = target_probs[emit_rows]  # [B, V]
    b = torch.arange(p.shape[0], device=p.device)
    if draft_probs is not None:
        safe_pos = emit_pos.clamp_max(max(flat_idx.shape[1] - 1, 0))
        q = draft_probs[flat_idx[b, safe_pos]] if flat_idx.shape[1] else torch.zeros_like(p)
    else:
        q = torch.zeros_like(p)
        if ids.shape[1]:
            x = ids[b, emit_pos.clamp_max(ids.shape[1] - 1)].clamp_min(0)
            q[b, x] = 1.0
    q = torch.where(rejected[:, None], q, torch.zeros_like(q))
    w = (p - q).clamp_min(0.0)
    empty = ~(w > 0).any(dim=1)
    w = torch.where(empty[:, None], p, w)
    score = torch.where(w > 0, w / exp_noise, torch.full_like(w, -1.0))
    return score.argmax(dim=1)


def rejection_sample_reference(
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
    exp_noise: torch.Tensor | None,
) -> torch.Tensor:
    """Verify (and sample) a batch; see the module docstring for the exact contract.

    Args:
        target_probs: [T, V] float32, the processed target distribution of each row (rows of
            greedy requests are not read; may be None when every request is greedy).
        target_argmax: [T] int64, argmax of the raw logits of each row (read for greedy requests).
        draft_token_ids: [D] int64, all drafts, flat, request after request.
        num_draft_tokens: [B] int64, k_i.
        draft_probs: [D, V] float32 drafter probabilities, or None (a drafter without
            probabilities: q(x) = 1 for the drafted token).
        is_greedy: [B] bool.
        uniforms: [D] float32 in [0, 1), one per draft (entries of greedy requests unused).
        exp_noise: [B, V] float32 >= 0, Exp(1) noise, one vector per request (rows of greedy
            requests unused; may be None when every request is greedy).

    Returns:
        [B, max_k + 1] int64: accepted drafts, the emitted token, then -1 padding.
    """
    k = num_draft_tokens.to(torch.int64)
    num_reqs = k.numel()
    max_k = int(k.max()) if num_reqs else 0
    row_starts, draft_starts = request_offsets(k)
    flat_idx, ids, valid = _padded_drafts(draft_token_ids, k, draft_starts, max_k)
    accept = _accept_mask(
        target_probs, target_argmax, draft_probs, is_greedy, uniforms, ids, flat_idx, valid, row_starts
    )
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # prefix rule
    emit_rows = row_starts + num_accepted
    emitted = target_argmax[emit_rows]
    if target_probs is not None and bool((~is_greedy).any()):
        assert exp_noise is not None, "exp_noise is required for random requests"
        rejected = num_accepted < k
        random_tok = _emit_random(
            target_probs, draft_probs, exp_noise, ids, flat_idx, emit_rows, num_accepted, rejected
        )
        emitted = torch.where(is_greedy, emitted, random_tok)
    out = torch.full((num_reqs, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=k.device)
    pos = torch.arange(max_k + 1, device=k.device)[None, :]
    pad = torch.full((num_reqs, 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=k.device)
    padded_ids = torch.cat([ids, pad], dim=1)
    out = torch.where(pos < num_accepted[:, None], padded_ids, out)
    out[torch.arange(num_reqs, device=k.device), num_accepted] = emitted
    return out


def num_emitted(output_token_ids: torch.Tensor) -> torch.Tensor:
    """[B] number of tokens each request emitted (accepted drafts + 1)."""
    return (output_token_ids != PLACEHOLDER_TOKEN_ID).sum(dim=1)
