"""Suffix-decoding proposer: local repeats, the global cache, variable lengths, LRU bounds."""

from __future__ import annotations

import random

from tokenbudget.scheduler.request import Request
from tokenbudget.spec.proposer import CommittedStep
from tokenbudget.spec.suffix import SuffixProposer


def _req(rid, prompt, output=(), max_tokens=1000):
    r = Request(rid, list(prompt), max_tokens=max_tokens)
    r.all_token_ids += list(output)
    return r


def test_repeated_text_is_proposed():
    sp = SuffixProposer(max_model_len=10_000)
    text = list(range(100, 120))
    r = _req("a", text + text[:5])
    (draft,) = sp.propose([r], [8]).token_ids
    assert draft == text[5:10]  # match length 5, max_spec_factor 1.0 -> 5 tokens
    sp = SuffixProposer(max_spec_factor=2.0, max_model_len=10_000)
    assert sp.propose([_req("b", text + text[:5])], [8]).token_ids == [text[5:13]]


def test_no_proposal_without_repeat():
    sp = SuffixProposer(max_model_len=10_000)
    assert sp.propose([_req("a", list(range(50)))], [8]).token_ids == [[]]
    assert sp.propose([_req("b", [1])], [8]).token_ids == [[]]


def test_global_cache_from_finished_request_helps_new_request():
    sp = SuffixProposer(max_model_len=10_000)
    answer = [500 + i for i in range(30)]
    done = _req("old", [1, 2, 3, 4], answer)
    sp.on_finished(done)
    assert sp.num_cached_requests == 1
    new = _req("new", [9, 8, 7], answer[:6])
    (draft,) = sp.propose([new], [10]).token_ids
    assert draft == answer[6:12]  # match length 6 -> up to 6 tokens with factor 1.0
    # a repeated prompt drafts its first output tokens from the cached prompt tail
    again = _req("again", [1, 2, 3, 4])
    (draft,) = sp.propose([again], [3]).token_ids
    assert draft == answer[:3]


def test_disabled_global_cache():
    sp = SuffixProposer(max_cached_requests=0, max_model_len=10_000)
    sp.on_finished(_req("old", [1, 2], list(range(40, 60))))
    assert sp.num_cached_requests == 0
    assert sp.propose([_req("new", [40, 41, 42])], [4]).token_ids == [[]]


def test_proposal_length_scales_with_match_length():
    sp = SuffixProposer(max_spec_factor=1.0, max_model_len=10_000)
    seq = list(range(200, 240))
    sp.on_finished(_req("old", [0], seq))
    lens = []
    for m in (2, 3, 5, 8):
        (d,) = sp.propose([_req(f"n{m}", [7] + seq[:m])], [16]).token_ids
        assert d == seq[m:m + len(d)]
        lens.append(len(d))
    assert lens == [2, 3, 5, 8]
    proposal = sp.propose([_req("n5", [7] + seq[:5]), ], [16])
    (d,) = proposal.token_ids
    assert proposal.kinds == [4]   # 4-7 -> 4
    proposal = sp.propose([_req("n9", [7] + seq[:9]), _req("n2", [7] + seq[:2]), _req("none", [1, 2])], [16, 16, 16])
    assert proposal.kinds == [8, 2, 0]
    sp2 = SuffixProposer(max_spec_factor=0.0, max_spec_offset=4, max_model_len=10_000)
    sp2.on_finished(_req("old", [0], seq))
    assert len(sp2.propose([_req("n", [7] + seq[:2])], [16]).token_ids[0]) == 4


def test_proposal_stops_at_uncertain_branch():
    # "1 2" is followed by "3" six times, then by 4 or 9 (3 times each): the walk takes 3
    # (p=1), then meets a 50/50 branch; min_token_prob 0.6 stops it there. The context's
    # "77" makes the match length 2, so no longer (more specific) match exists.
    sp = SuffixProposer(min_token_prob=0.6, max_spec_factor=4.0, max_model_len=10_000)
    ctx = []
    for tail in (4, 9, 4, 9, 4, 9):
        ctx += [1, 2, 3, tail, 0]
    (d,) = sp.propose([_req("a", ctx + [77, 1, 2])], [8]).token_ids
    assert d == [3]
    sp = SuffixProposer(min_token_prob=0.4, max_spec_factor=4.0, max_model_len=10_000)
    (d,) = sp.propose([_req("b", ctx + [77, 1, 2])], [8]).token_ids
    # tie broken toward the most recent occurrence (9); then 0 (p=.5); then 1 has 2/3 -> .33
    assert d == [3, 9, 0]


def test_lengths_vary_across_requests():
    sp = SuffixProposer(max_model_len=10_000)
    reqs = [_req("a", [1, 2, 3, 4, 5, 6, 7, 1, 2]), _req("b", [5, 6, 7, 8, 5, 6, 7, 8, 9, 5, 6, 7]),
            _req("c", [3, 1, 4, 1, 5])]
    drafts = sp.propose(reqs, [8, 8, 8]).token_ids
    assert [len(d) for d in drafts] == [2, 3, 0]


def test_clipped_to_max_model_len_and_max_tokens():
    text = list(range(10, 40))
    sp = SuffixProposer(max_model_len=len(text) + 8)
    (d,) = sp.propose([_req("a", text + text[:10])], [16]).token_ids
    assert len(d) == 0  # L = 40 > max_model_len - 1
    sp = SuffixProposer(max_model_len=45)
    (d,) = sp.propose([_req("b", text + text[:10])], [16]).token_ids
    assert d == text[10:14]  # 45 - 40 - 1
    sp = SuffixProposer(max_model_len=1000)
    (d,) = sp.propose([_req("c", text, text[:10], max_tokens=12)], [16]).token_ids
    assert d == text[10:11]


def test_lru_eviction_bounds_memory():
    rng = random.Random(0)
    sp = SuffixProposer(max_cached_requests=3, max_model_len=10_000)
    seqs = []
    for i in range(40):
        out = [rng.randrange(10_000) for _ in range(50)]
        seqs.append(out)
        sp.on_finished(_req(f"r{i}", [i], out))
        assert sp.num_cached_requests <= 3
        assert sp.num_index_entries <= 2 * 3 * 52 + 1024
    # the oldest is gone, the newest is still served
    assert sp.propose([_req("x", [1] + seqs[0][:6])], [4]).token_ids == [[]]
    assert sp.propose([_req("y", [1] + seqs[-1][:6])], [4]).token_ids == [seqs[-1][6:10]]


def test_lru_keeps_recently_used():
    sp = SuffixProposer(max_cached_requests=2, max_model_len=10_000)
    a, b, c = ([base + i for i in range(20)] for base in (100, 200, 300))
    sp.on_finished(_req("a", [0], a))
    sp.on_finished(_req("b", [0], b))
    assert sp.propose([_req("use_a", [1] + a[:4])], [2]).token_ids == [a[4:6]]  # uses a ...
    # ... in a step that failed: its receipt is never handed back, no touch
    proposal = sp.propose([_req("use_a", [1] + a[:4])], [2])
    assert proposal.token_ids == [a[4:6]]
    sp.on_commit(CommittedStep(None, [], None, [proposal.receipt]))  # committed: a is the most recently used
    sp.on_finished(_req("c", [0], c))  # evicts b, the least recently used
    assert sp.propose([_req("qa", [1] + a[:4])], [2]).token_ids == [a[4:6]]
    assert sp.propose([_req("qb", [1] + b[:4])], [2]).token_ids == [[]]


def test_rolled_back_touch_changes_nothing():
    sp = SuffixProposer(max_cached_requests=2, max_model_len=10_000)
    a, b, c = ([base + i for i in range(20)] for base in (100, 200, 300))
    sp.on_finished(_req("a", [0], a))
    sp.on_finished(_req("b", [0], b))
    assert sp.propose([_req("use_a", [1] + a[:4])], [2]).token_ids == [a[4:6]]  # a step that failed
    sp.on_finished(_req("c", [0], c))  # evicts a: the failed step touched nothing
    assert sp.propose([_req("qa", [1] + a[:4])], [2]).token_ids == [[]]
    assert sp.propose([_req("qb", [1] + b[:4])], [2]).token_ids == [b[4:6]]


def test_per_request_state_is_in_the_tables():
    """The engine's release path drops a finished request's records from every table."""
    sp = SuffixProposer(max_model_len=10_000)
    r = _req("a", [1, 2, 3, 1, 2])
    sp.propose([r], [4])
    r.all_token_ids.append(3)
    sp.propose([r], [4])
    assert "a" in sp.local and sp.local in sp.tables
