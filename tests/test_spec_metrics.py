"""SpecDecodingStats arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenbudget.spec.metrics import SpecDecodingStats


def test_empty():
    s = SpecDecodingStats()
    assert s.acceptance_rate == 0.0 and s.mean_accepted_length == 1.0
    assert s.acceptance_by_position() == []
    assert "drafts=0" in s.summary()


def test_observe_arithmetic():
    s = SpecDecodingStats()
    s.observe(4, 2)
    s.observe(2, 2)
    s.observe(0, 0)  # plain decode step
    s.observe(3, 0)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 9, 4)
    assert s.acceptance_rate == pytest.approx(4 / 9)
    assert s.mean_accepted_length == pytest.approx(1 + 4 / 3)
    assert s.accepted_per_pos == [2, 2, 0, 0]
    assert s.drafted_per_pos == [3, 3, 2, 1]
    assert s.acceptance_by_position() == pytest.approx([2 / 3, 2 / 3, 0.0, 0.0])
    assert s.k_histogram == {4: 1, 2: 1, 0: 1, 3: 1}
    d = s.as_dict()
    assert d["num_drafts"] == 3 and d["k_histogram"] == {0: 1, 2: 1, 3: 1, 4: 1}
    line = s.summary()
    assert "\n" not in line and "alpha=0.444" in line and "tau=2.33" in line


def test_observe_rejects_bad_counts():
    s = SpecDecodingStats()
    with pytest.raises(ValueError):
        s.observe(2, 3)
    with pytest.raises(ValueError):
        s.observe(2, -1)
    assert s.num_drafts == 0 and s.k_histogram == {}


obs = st.lists(st.integers(0, 6).flatmap(lambda k: st.tuples(st.just(k), st.integers(0, k))),
               max_size=30)


@given(obs, obs)
def test_merge_equals_observing_everything(a, b):
    sa, sb, sall = SpecDecodingStats(), SpecDecodingStats(), SpecDecodingStats()
    for k, n in a:
        sa.observe(k, n)
        sall.observe(k, n)
    for k, n in b:
        sb.observe(k, n)
        sall.observe(k, n)
    assert sa.merge(sb).as_dict() == sall.as_dict()
    # accepted counts never increase with position (invariant 7)
    assert all(x >= y for x, y in zip(sall.accepted_per_pos, sall.accepted_per_pos[1:]))


def test_reset():
    s = SpecDecodingStats()
    s.observe(3, 1)
    s.reset()
    assert s.as_dict() == SpecDecodingStats().as_dict()
