"""Sampler: greedy, logits processing, masks, seeds, logprobs and the distribution under speculation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.worker.logits_processing import compute_target_probs
from tokenbudget.engine.worker.sampler import Sampler, SamplingRow

SAMPLER = Sampler()
GREEDY = SamplingParams(temperature=0.0)


def naive_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """temperature -> min-p -> top-k -> top-p -> softmax, one row, float64, written plainly."""
    x = logits.astype(np.float64) / p.temperature

    def softmax(z):
        z = np.exp(z - z[np.isfinite(z)].max())
        return z / z.sum()

    if p.min_p > 0:
        pr = softmax(x)
        x = np.where(pr < p.min_p * pr.max(), -np.inf, x)
    if p.top_k > 0 and p.top_k < len(x):
        kth = np.sort(x)[::-1][p.top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if p.top_p < 1:
        pr = softmax(x)
        order = np.argsort(-x, kind="stable")
        before = 0.0
        for idx in order:
            if before >= p.top_p:
                x[idx] = -np.inf
            before += pr[idx]
    return softmax(x)


def _rows(params, drafts=None, probs=None, seeds=None, position=0):
    """One row per request; request i's random numbers are keyed by ``seeds[i]`` (default i)."""
    n = len(params)
    return [
        SamplingRow(
            params[i],
            i if seeds is None else seeds[i],
            position,
            [] if drafts is None else list(drafts[i]),
            None if probs is None else probs[i],
        )
        for i in range(n)
    ]


def test_plain_greedy_is_argmax_with_lowest_index_ties():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    logits[3] = 0.0
    logits[3, 7] = logits[3, 9] = 5.0
    params = [GREEDY, SamplingParams(temperature=0.9, top_k=1)] * 4
    out = SAMPLER(logits, _rows(params))
    assert out.token_ids == [[t] for t in logits.argmax(dim=-1).tolist()]
    assert out.token_ids[3] == [7]
    assert out.logprobs is None


def test_greedy_verification_chain_mismatch_and_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(5 + 5 + 1 + 3, 40)
    am = logits.argmax(dim=-1).tolist()
    wrong = (am[7] + 1) % 40
    drafts = [am[0:4], [am[5], am[6], wrong, am[8]], [], [am[11], (am[12] + 1) % 40]]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.7), GREEDY]
    out = SAMPLER(logits, _rows(params, drafts))
    assert out.token_ids[0] == am[0:5]  # all accepted + bonus argmax
    assert out.token_ids[1] == [am[5], am[6], am[7]]  # first mismatch gives the argmax
    assert len(out.token_ids[2]) == 1
    assert out.token_ids[3] == [am[11], am[12]]


def test_processing_matches_naive_implementation():
    rng = np.random.default_rng(7)
    params = []
    for _ in range(40):
        params.append(
            SamplingParams(
                temperature=float(rng.choice([0.3, 0.7, 1.0, 1.8])),
                top_k=int(rng.choice([0, -1, 2, 5, 13, 40])),
                top_p=float(rng.choice([1.0, 0.9, 0.5, 0.05])),
                min_p=float(rng.choice([0.0, 0.05, 0.3])),
            )
        )
    logits = rng.normal(size=(40, 20)).astype(np.float32) * 3
    got = compute_target_probs(torch.from_numpy(logits), params).numpy()
    for i, p in enumerate(params):
        expect = naive_probs(logits[i], p)
        assert np.array_equal(got[i] > 0, expect > 0), (i, p)
        np.testing.assert_allclose(got[i], expect, atol=1e-5)


MASK_CASES = [
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.5, temperature=1.3),
    SamplingParams(min_p=0.2),
    SamplingParams(top_k=6, top_p=0.8, min_p=0.05, temperature=0.5),
]


@pytest.mark.parametrize("params", MASK_CASES)
@pytest.mark.parametrize("with_q", [False, True])
def test_excluded_tokens_are_never_emitted(params, with_q):
    torch.manual_seed(3)
    vocab, n, k = 12, 1500, 2
    base = torch.randn(k + 1, vocab) * 2
    base[:, 11] = float("-inf")
    allowed = [set(np.flatnonzero(naive_probs(base[j].numpy(), params) > 0).tolist()) for j in range(k + 1)]
    assert all(11 not in a and len(a) < vocab - 1 for a in allowed)
    logits = base.repeat(n, 1)
    drafts = torch.randint(0, vocab, (n, k)).tolist()
    probs = [torch.full((k, vocab), 1.0 / vocab)] * n if with_q else None
    out = SAMPLER(logits, _rows([params] * n, drafts, probs))
    for toks in out.token_ids:
        assert all(t in allowed[j] for j, t in enumerate(toks))


def test_seeded_rows_are_reproducible_and_independent_of_neighbours():
    torch.manual_seed(4)
    vocab = 30
    seeded = SamplingParams(temperature=1.0, seed=42)
    own_logits = torch.randn(3, vocab)
    own_drafts = [1, 2]

    def run(neighbours: list[tuple[SamplingParams, list[int], int]], seed: int = 42) -> list[list[int]]:
        results = []
        for position in range(10, 15):  # five steps
            rows = [SamplingRow(p, s, position, d, None) for p, d, s in neighbours]
            rows.insert(1 if neighbours else 0, SamplingRow(seeded, seed, position, own_drafts, None))
            parts = [torch.randn(len(r.draft_token_ids) + 1, vocab) for r in rows]
            parts[1 if neighbours else 0] = own_logits
            out = SAMPLER(torch.cat(parts), rows)
            results.append(out.token_ids[1 if neighbours else 0])
        return results

    alone = run([])
    assert run([]) == alone
    crowd = [(SamplingParams(), [3, 4, 5], 7), (GREEDY, [0], 8), (SamplingParams(top_p=0.3), [], 9)]
    assert run(crowd) == alone
    assert run(crowd[::-1]) == alone
    assert any(run([], seed=s) != alone for s in (1, 2, 3))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), drafts=st.lists(st.integers(0, 7), max_size=4), with_q=st.booleans())
def test_seeded_output_does_not_depend_on_drafts(seed, drafts, with_q):
    """A seeded request emits exactly what plain decoding (no drafts) emits at those positions."""
    vocab, position = 8, 5
    logits = torch.randn(len(drafts) + 1, vocab, generator=torch.Generator().manual_seed(seed % 2**31))
    params = SamplingParams(temperature=0.9, top_k=6, seed=seed)
    plain = [SAMPLER(logits[j:j + 1], [SamplingRow(params, seed, position + j)]).token_ids[0][0]
             for j in range(len(drafts) + 1)]
    q = torch.softmax(torch.randn(len(drafts), vocab), -1) if with_q and drafts else None
    out = SAMPLER(logits, [SamplingRow(params, seed, position, drafts, q)]).token_ids[0]
    assert out == plain[:len(out)]
    assert out[:-1] == drafts[:len(out) - 1]


def test_logprobs_are_raw_logsoftmax_of_the_predicting_row():
    torch.manual_seed(5)
    vocab = 16
    logits = torch.randn(3 + 1, vocab)
    am = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.5, logprobs=0)]
    out = SAMPLER(logits, _rows(params, [[am[0], am[1]], []]))
    raw = logits.log_softmax(dim=-1)
    assert out.token_ids[0] == am[0:3]
    for j, (tok, entry) in enumerate(zip(out.token_ids[0], out.logprobs[0])):
        assert entry.logprob == pytest.approx(raw[j, tok].item())
        top = raw[j].topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist())
    (only,) = out.logprobs[1]
    assert only.logprob == pytest.approx(raw[3, out.token_ids[1][0]].item()) and only.top == []
    out = SAMPLER(logits, _rows([GREEDY, SamplingParams(logprobs=1)], [[am[0], am[1]], []]))
    assert out.logprobs[0] is None and len(out.logprobs[1]) == 1


def test_bad_inputs_raise_value_error():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="logits"):
        SAMPLER(logits, _rows([GREEDY]))
    with pytest.raises(ValueError, match="draft_token_ids"):
        SAMPLER(logits, _rows([GREEDY], [[1, 8]]))
    with pytest.raises(ValueError, match="draft_probs"):
        SAMPLER(logits, _rows([SamplingParams()], [[1, 2]], [torch.ones(3, 8)]))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    ks=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    temps=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=6, max_size=6),
    with_q=st.booleans(),
)
def test_output_is_draft_prefix_plus_one(seed, ks, temps, with_q):
    g = torch.Generator().manual_seed(seed)
    vocab = 5
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=g) * 2
    drafts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in ks]
    probs = [torch.softmax(torch.randn(k, vocab, generator=g), -1) for k in ks] if with_q else None
    params = [SamplingParams(temperature=temps[i]) for i in range(len(ks))]
    out = SAMPLER(logits, _rows(params, drafts, probs))
    accepted = np.zeros(max(ks) + 1, dtype=int)
    for toks, d in zip(out.token_ids, drafts):
        a = len(toks) - 1
        assert 0 <= a <= len(d) and toks[:a] == d[:a] and 0 <= toks[-1] < vocab
        accepted[:a] += 1
    assert all(accepted[j] >= accepted[j + 1] for j in range(max(ks)))


# --- distribution of committed tokens under speculation, through the Sampler ---

N = 20_000
LOGITS = torch.tensor(
    [[1.0, 0.2, -0.5, 2.0, 0.0, -3.0], [0.1, 1.5, 0.3, -1.0, 0.8, 0.0], [0.0] * 6],
    dtype=torch.float32,
)
SPEC_PARAMS = SamplingParams(temperature=0.8, top_k=5)  # token 5 (lowest) is excluded at row 0


def _chisq(tokens: np.ndarray, p: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, counts
    nz = p > 0
    assert chisquare(counts[nz], p[nz] / p[nz].sum() * counts[nz].sum()).pvalue > 1e-3, counts


@pytest.mark.parametrize("drafter", ["with_probs", "fixed_token"])
def test_committed_tokens_follow_target_under_speculation(drafter):
    torch.manual_seed(2024)
    p0 = naive_probs(LOGITS[0].numpy(), SPEC_PARAMS)
    p1 = naive_probs(LOGITS[1].numpy(), SPEC_PARAMS)
    assert p0[5] == 0
    if drafter == "with_probs":
        q = torch.tensor([[0.1, 0.3, 0.2, 0.1, 0.2, 0.1], [0.3, 0.1, 0.2, 0.2, 0.1, 0.1]])
        drafts = torch.stack([torch.multinomial(q[0], N, True), torch.multinomial(q[1], N, True)], 1).tolist()
        probs = [q] * N
    else:
        drafts, probs = [[3, 1]] * N, None  # no probabilities: q(x) = 1 for the proposed token
    out = SAMPLER(LOGITS.repeat(N, 1), _rows([SPEC_PARAMS] * N, drafts, probs))
    first = np.array([t[0] for t in out.token_ids])
    _chisq(first, p0)
    second = np.array([t[1] for t in out.token_ids if len(t) > 1])
    if drafter == "with_probs":  # conditional on the first draft being accepted
        assert len(second) > N // 5
    else:  # the fixed drafter is accepted exactly when the target draws token 3
        assert len(second) == pytest.approx(N * p0[3], rel=0.05)
    _chisq(second, p1)


def test_drafter_without_probs_is_unaffected_by_neighbours_with_probs():
    torch.manual_seed(6)
    vocab = 9
    own_logits = torch.randn(4, vocab)
    other_logits = torch.randn(3, vocab)
    seeded = SamplingParams(seed=1)
    results = []
    for neighbour_probs in (None, torch.softmax(torch.randn(2, vocab), -1)):
        outs = []
        for position in range(20):
            rows = [SamplingRow(seeded, 1, position, [2, 5, 7], None),
                    SamplingRow(SamplingParams(), 3, position, [1, 3], neighbour_probs)]
            outs.append(SAMPLER(torch.cat([own_logits, other_logits]), rows).token_ids[0])
        results.append(outs)
    assert results[0] == results[1]
