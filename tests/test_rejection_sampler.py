"""The torch reference rejection sampler against a literal scalar implementation of its contract,
plus the properties and the output distribution the contract promises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from tokenbudget.kernels.rejection_ref import (
    PLACEHOLDER_TOKEN_ID,
    num_emitted,
    rejection_sample_reference,
    request_offsets,
)


def naive_reference(target_probs, target_argmax, drafts, ks, draft_probs, greedy, uniforms, noise):
    """The module docstring's rule, one request and one position at a time, in float32."""
    out = []
    row = d = 0
    for i, k in enumerate(ks):
        toks = []
        e = k
        for j in range(k):
            x = drafts[d + j]
            if greedy[i]:
                ok = x == target_argmax[row + j]
            else:
                q = np.float32(1.0) if draft_probs is None else draft_probs[d + j][x]
                ok = np.float32(uniforms[d + j]) * q < target_probs[row + j][x]
            if not ok:
                e = j
                break
            toks.append(x)
        if greedy[i]:
            toks.append(target_argmax[row + e])
        else:
            p = target_probs[row + e]
            if e < k:
                if draft_probs is None:
                    q = np.zeros_like(p)
                    q[drafts[d + e]] = 1.0
                else:
                    q = draft_probs[d + e]
                w = np.maximum(p - q, np.float32(0))
                if not (w > 0).any():
                    w = p
            else:
                w = p
            score = np.where(w > 0, w / noise[i], np.float32(-1))
            toks.append(int(np.argmax(score)))
        out.append(toks)
        row += k + 1
        d += k
    return out


def _random_probs(rng: np.random.Generator, n: int, v: int) -> np.ndarray:
    """Rows of probabilities with some exact zeros (but never an all-zero row)."""
    raw = rng.random((n, v)).astype(np.float32)
    raw[rng.random((n, v)) < 0.3] = 0
    raw[np.arange(n), rng.integers(0, v, n)] += np.float32(0.1)
    return (raw / raw.sum(axis=1, keepdims=True)).astype(np.float32)


def _f64(p: np.ndarray) -> np.ndarray:
    p = p.astype(np.float64)
    return p / p.sum()


def _case(seed: int, ks: list[int], vocab: int, with_q: bool, greedy_frac: float, aligned: bool):
    rng = np.random.default_rng(seed)
    t, d, b = sum(ks) + len(ks), sum(ks), len(ks)
    p = _random_probs(rng, t, vocab)
    argmax = rng.integers(0, vocab, t)
    q = _random_probs(rng, d, vocab) if with_q else None
    drafts = rng.integers(0, vocab, d)
    if aligned:  # make drafts often right so long accepted prefixes occur
        starts = request_offsets(torch.tensor(ks))[0].tolist()
        rows = np.concatenate([s + np.arange(k) for s, k in zip(starts, ks)]).astype(int)
        mask = rng.random(d) < 0.7
        drafts = np.where(mask, argmax[rows] if d else drafts, drafts)
    greedy = rng.random(b) < greedy_frac
    u = rng.random(d).astype(np.float32)
    noise = rng.exponential(size=(b, vocab)).astype(np.float32)
    return p, argmax, drafts, q, greedy, u, noise


def _run_reference(p, argmax, drafts, ks, q, greedy, u, noise):
    out = rejection_sample_reference(
        torch.from_numpy(p),
        torch.from_numpy(argmax).long(),
        torch.from_numpy(drafts).long(),
        torch.tensor(ks, dtype=torch.int64),
        None if q is None else torch.from_numpy(q),
        torch.from_numpy(greedy),
        torch.from_numpy(u),
        torch.from_numpy(noise),
    )
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()], out


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    ks=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    vocab=st.integers(2, 9),
    with_q=st.booleans(),
    greedy_frac=st.sampled_from([0.0, 0.5, 1.0]),
    aligned=st.booleans(),
)
def test_reference_matches_literal_rule_and_properties(seed, ks, vocab, with_q, greedy_frac, aligned):
    p, argmax, drafts, q, greedy, u, noise = _case(seed, ks, vocab, with_q, greedy_frac, aligned)
    got, padded = _run_reference(p, argmax, drafts, ks, q, greedy, u, noise)
    assert got == naive_reference(p, argmax, drafts.tolist(), ks, q, greedy, u, noise)
    assert padded.shape == (len(ks), max(ks) + 1)
    assert num_emitted(padded).tolist() == [len(g) for g in got]
    row_starts, draft_starts = request_offsets(torch.tensor(ks))
    max_k = max(ks)
    accepted_at = np.zeros(max_k + 1, dtype=int)
    for i, (toks, k) in enumerate(zip(got, ks)):
        own = drafts[int(draft_starts[i]) : int(draft_starts[i]) + k].tolist()
        a = len(toks) - 1
        assert 0 <= a <= k and toks[:a] == own[:a]  # a prefix of the drafts + exactly one token
        accepted_at[:a] += 1
        if not greedy[i]:  # zero target probability is never emitted
            s = int(row_starts[i])
            assert all(p[s + j][t] > 0 for j, t in enumerate(toks))
    assert all(accepted_at[j] >= accepted_at[j + 1] for j in range(max_k))


def test_greedy_chain_and_first_mismatch():
    argmax = torch.tensor([3, 1, 4, 1, 5])  # request 0: k=4 -> rows 0..4
    ones = torch.ones(1, 6)
    greedy = torch.tensor([True])
    u = torch.zeros(4)
    for drafts, expect in [
        ([3, 1, 4, 1], [3, 1, 4, 1, 5]),
        ([3, 1, 0, 1], [3, 1, 4]),
        ([0, 1, 4, 1], [3]),
    ]:
        out = rejection_sample_reference(
            None, argmax, torch.tensor(drafts), torch.tensor([4]), None, greedy, u, None
        )
        assert [t for t in out[0].tolist() if t >= 0] == expect
    out = rejection_sample_reference(None, torch.tensor([2]), torch.tensor([], dtype=torch.long),
                                     torch.tensor([0]), None, greedy, torch.zeros(0), ones)
    assert out.tolist() == [[2]]


def test_perfect_drafter_is_always_accepted():
    rng = np.random.default_rng(0)
    ks = [3] * 50
    p = _random_probs(rng, 200, 7)
    q = np.concatenate([p[s : s + 3] for s in range(0, 200, 4)])
    drafts = np.array([rng.choice(7, p=_f64(row)) for row in q])
    u = rng.random(150).astype(np.float32)
    noise = rng.exponential(size=(50, 7)).astype(np.float32)
    got, _ = _run_reference(p, np.zeros(200, dtype=np.int64), drafts, ks, q, np.zeros(50, bool), u, noise)
    assert all(len(g) == 4 for g in got)


# --- distribution: committed tokens follow the target exactly (fixed seeds, vectorized) ---

P0 = np.array([0.30, 0.05, 0.0, 0.25, 0.15, 0.25], dtype=np.float32)  # token 2 impossible
P1 = np.array([0.10, 0.40, 0.20, 0.0, 0.10, 0.20], dtype=np.float32)  # token 3 impossible
Q0 = np.array([0.10, 0.30, 0.20, 0.10, 0.20, 0.10], dtype=np.float32)
Q1 = np.array([0.25, 0.15, 0.15, 0.15, 0.15, 0.15], dtype=np.float32)
N = 20_000


def _chisq_ok(tokens: np.ndarray, p: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, counts
    nz = p > 0
    expected = _f64(p[nz]) * counts[nz].sum()
    assert chisquare(counts[nz], expected).pvalue > 1e-3, (counts, expected)


@pytest.mark.parametrize("with_q", [True, False])
def test_committed_distribution_equals_target(with_q):
    rng = np.random.default_rng(1234)
    p = np.tile(np.stack([P0, P1, P0]), (N, 1))  # k = 2 per request
    if with_q:
        q_rows = np.stack([Q0, Q1])
        drafts = np.stack([rng.choice(6, N, p=_f64(Q0)),
                           rng.choice(6, N, p=_f64(Q1))], axis=1).reshape(-1)
        q = np.tile(q_rows, (N, 1))
    else:  # drafter without probabilities that always proposes token 2, then token 1
        drafts = np.tile(np.array([2, 1]), N)
        q = None
    u = rng.random(2 * N).astype(np.float32)
    noise = rng.exponential(size=(N, 6)).astype(np.float32)
    got, padded = _run_reference(p, np.zeros(3 * N, np.int64), drafts, [2] * N, q, np.zeros(N, bool), u, noise)
    padded = padded.numpy()
    _chisq_ok(padded[:, 0], P0)
    second = padded[:, 1][padded[:, 1] >= 0]
    if with_q:  # given the first draft was accepted, the second committed token follows P1
        assert len(second) > N // 4
        _chisq_ok(second, P1)
    else:
        assert len(second) == 0  # token 2 has p = 0: the fixed drafter is always rejected
    assert np.all(padded[:, 0] != 2)
