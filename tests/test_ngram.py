"""N-gram (prompt lookup) proposer: hand cases, clipping, and Hypothesis properties."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.scheduler.drafts import draft_limit
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.ngram import NgramIndex, NgramProposer, ngram_propose_reference


def _req(tokens, prompt_len=None, max_tokens=1000, rid="r"):
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    r = Request(rid, tokens[:prompt_len], max_tokens=max_tokens)
    r.all_token_ids = list(tokens)
    return r


def _lookup(tokens, k, lo, hi, prefer="recent"):
    idx = NgramIndex(lo, hi, prefer)
    idx.sync(list(tokens))
    return idx.lookup(k)


def test_simple_continuation():
    assert _lookup([1, 2, 3, 4, 9, 1, 2], 2, 1, 3) == [3, 4]


def test_no_match():
    assert _lookup([1, 2, 3, 4, 5], 3, 1, 3) == []
    assert _lookup([7], 3, 1, 3) == []
    assert _lookup([], 3, 1, 3) == []


def test_longest_ngram_wins():
    # suffix "5 6": the 2-gram occurred once (followed by 7); the 1-gram "6" more recently (-> 0)
    toks = [5, 6, 7, 1, 6, 0, 2, 5, 6]
    assert _lookup(toks, 1, 1, 2) == [7]
    assert _lookup(toks, 1, 1, 1) == [0]


def test_min_bound_rejects_short_match():
    toks = [1, 2, 3, 9, 3]  # only a 1-gram match
    assert _lookup(toks, 2, 1, 3) == [9, 3]
    assert _lookup(toks, 2, 2, 3) == []


def test_max_bound_limits_match():
    # 3-gram "1 2 3" -> 4; 2-gram "2 3" most recently -> 8
    toks = [1, 2, 3, 4, 2, 3, 8, 1, 2, 3]
    assert _lookup(toks, 1, 1, 3) == [4]
    assert _lookup(toks, 1, 1, 2) == [8]


def test_multiple_occurrences_recent_vs_earliest():
    toks = [1, 2, 10, 1, 2, 20, 1, 2]
    assert _lookup(toks, 1, 2, 2, "recent") == [20]
    assert _lookup(toks, 1, 2, 2, "earliest") == [10]


def test_overlapping_match_repeats_period():
    # "a b a b a b": suffix "a b" last seen ending 2 before -> period-2 copy
    assert _lookup([1, 2, 1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]
    assert _lookup([4, 7, 7, 7], 3, 1, 2) == [7, 7, 7]


def test_proposer_clips_to_max_model_len_and_max_tokens():
    toks = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    prop = NgramProposer(1, 3, max_model_len=12)
    r = _req(toks)
    # L=9, max_model_len=12 -> at most 12 - 9 - 1 = 2 drafts
    assert prop.propose([r], [5]).token_ids == [[4, 5]]
    assert len(r.all_token_ids) + 2 < 12
    prop = NgramProposer(1, 3, max_model_len=100)
    r = _req(toks, prompt_len=7, max_tokens=4)  # 2 outputs so far, 2 left -> 1 useful draft
    assert prop.propose([r], [5]).token_ids == [[4]]
    r = _req(toks, prompt_len=7, max_tokens=3)
    assert prop.propose([r], [5]).token_ids == [[]]
    r = _req(toks)
    r.max_spec_tokens = 0
    assert prop.propose([r], [5]).token_ids == [[]]


def test_draft_limit():
    r = _req(list(range(10)), prompt_len=8, max_tokens=10)
    assert draft_limit(r, max_model_len=100) == 10 - 2 - 1
    assert draft_limit(r, max_model_len=12) == 1
    assert draft_limit(r, max_model_len=10) == 0
    assert draft_limit(r, max_model_len=100, k=3) == 3
    r.max_spec_tokens = 2
    assert draft_limit(r, max_model_len=100) == 2
    assert NgramProposer(1, 2, max_model_len=13).propose([_req([1, 2, 3, 1, 2])], [4]).token_ids == [[3, 1, 2, 3]]


def test_incremental_across_steps_and_finish():
    prop = NgramProposer(2, 3, max_model_len=1000)
    r = _req([1, 2, 3, 4])
    assert prop.propose([r], [2]).token_ids == [[]]
    r.all_token_ids += [1, 2]
    assert prop.propose([r], [2]).token_ids == [[3, 4]]
    r.all_token_ids += [3, 9, 1, 2]
    assert prop.propose([r], [2]).token_ids == [[3, 9]]
    for table in prop.tables:  # the engine's release path
        table.drop(r.request_id)
    assert prop.num_tracked_requests == 0


def test_batch_of_requests():
    prop = NgramProposer(1, 2, max_model_len=1000)
    reqs = [_req([1, 2, 3, 1], rid="a"), _req([5, 6], rid="b"), _req([9, 9, 9], rid="c")]
    proposal = prop.propose(reqs, [2, 2, 1])
    assert proposal.token_ids == [[2, 3], [], [9]]
    assert proposal.kinds == [1, 0, 2]   # the matched suffix's length


tokens_st = st.lists(st.integers(0, 4), min_size=0, max_size=60)


@settings(max_examples=150, deadline=None)
@given(tokens_st, st.integers(1, 6), st.integers(1, 3), st.integers(0, 2),
       st.sampled_from(["recent", "earliest"]))
def test_proposal_copies_an_earlier_occurrence(tokens, k, lo, extra, prefer):
    hi = lo + extra
    prop = _lookup(tokens, k, lo, hi, prefer)
    assert prop == ngram_propose_reference(tokens, k, lo, hi, prefer)
    L = len(tokens)
    if not prop:
        # no n-gram in [lo, hi] of the suffix occurred earlier
        for n in range(lo, min(hi, L - 1) + 1):
            suf = tokens[L - n:]
            assert all(tokens[j - n:j] != suf for j in range(n, L))
        return
    assert len(prop) == k
    ext = tokens + prop
    ok = any(tokens[j - n:j] == tokens[L - n:] and ext[j:j + k] == prop
             for n in range(lo, min(hi, L - 1) + 1) for j in range(n, L))
    assert ok


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=25), min_size=1, max_size=6),
       st.integers(1, 3), st.integers(1, 3), st.sampled_from(["recent", "earliest"]))
def test_incremental_index_equals_brute_force(chunks, lo, width, prefer):
    hi = lo + width - 1
    idx = NgramIndex(lo, hi, prefer)
    tokens: list[int] = []
    for chunk in chunks:
        tokens.extend(chunk)  # the same list object grows, as all_token_ids does
        idx.sync(tokens)
        for k in (1, 4):
            assert idx.lookup(k) == ngram_propose_reference(tokens, k, lo, hi, prefer)
    fresh = NgramIndex(lo, hi, prefer)
    fresh.sync(list(tokens))
    assert fresh.table == idx.table


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(3, 50),
       st.integers(0, 8))
def test_never_past_max_model_len(tokens, max_model_len, k):
    prop = NgramProposer(1, 3, max_model_len=max_model_len)
    r = _req(tokens)
    (drafts,) = prop.propose([r], [k]).token_ids
    assert len(drafts) <= k
    assert len(drafts) == 0 or len(tokens) + len(drafts) < max_model_len
