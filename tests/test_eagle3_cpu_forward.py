"""The EAGLE-3 head's C forward (``engine.model.eagle3_cpu``, ``tb_eagle3``) against the head's
torch forward on the same quantized weights: the same outputs and K/V up to float rounding, rows
computed from themselves alone (the same bits in any batch), nothing written outside a segment's
rows, and bad arguments refused before the C code touches memory."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.engine.drafters.eagle3_kv import HeadState, segment_attend
from tokenbudget.engine.model.eagle3_cpu import Eagle3CpuForward, quantize_head
from tokenbudget.engine.model.quant import Q8Embedding
from tokenbudget.kernels.cpu.native import library, unavailable_reason

from eagle3_fixtures import random_head
from native_variants import use_variant

pytestmark = pytest.mark.skipif(library() is None, reason=f"no C kernels: {unavailable_reason()}")


def _table(c, seed: int = 11) -> tuple[torch.Tensor, Q8Embedding]:
    """A random embedding table, as fp32 and as the Q8_0 rows that hold it exactly."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (c.vocab_size, c.hidden_size), generator=gen, dtype=torch.int8)
    scales = (torch.rand(c.vocab_size, c.hidden_size // 32, generator=gen) * 0.02 + 0.001).to(torch.float16)
    table = (codes.float().view(c.vocab_size, -1, 32) * scales.float().unsqueeze(-1)).view(c.vocab_size, -1)
    return table.contiguous(), Q8Embedding(codes, scales)


def _head(mode: str = "int8", q8: bool = False, **overrides):
    head = random_head(5, **overrides)
    quantize_head(head, mode)
    table, q8_table = _table(head.config)
    forward = Eagle3CpuForward.build(head, q8_table if q8 else table)
    assert forward is not None
    return head, forward, table


def _inputs(head, lens, cached: int, seed: int = 0, fuse: bool = True):
    c = head.config
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    ids = torch.randint(0, c.vocab_size, (n,), generator=gen).tolist()
    states = torch.randn(n, 3 * c.target_hidden_size if fuse else c.hidden_size, generator=gen)
    positions = torch.cat([torch.arange(m) + cached + 2 * i for i, m in enumerate(lens)]).tolist()
    kv = [torch.randn(2, cached + m + 5, c.num_key_value_heads, c.head_dim, generator=gen) for m in lens]
    return ids, states, positions, kv


def _torch_forward(head, table, ids, states, positions, segments, fuse):
    """The head's torch forward on the same rows (``segments``: HeadState, at, n)."""
    last = torch.tensor([n for _, _, n in segments]).cumsum(0) - 1
    with torch.inference_mode():
        hidden = head.fuse(states) if fuse else states
        h, logits = head(table[torch.tensor(ids)], hidden, torch.tensor(positions),
                         segment_attend(segments, last_only=True), out_rows=last)
    return h, logits, head.to_target_ids(logits.argmax(-1)).tolist()


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("lens,fuse", [((1,), False), ((1, 1, 1), False), ((6,), True), ((5, 1, 9), True)])
def test_matches_the_torch_forward(mode, lens, fuse) -> None:
    """Catch-up segments (tap states through fc, many rows, only the last queries) and draft steps
    (one row each, the previous step's outputs), after 3 cached rows: outputs, greedy drafts and
    every written K/V row agree with the torch forward; the rows around the segment are untouched."""
    head, forward, table = _head(mode)
    cached = 3
    ids, states, positions, kv = _inputs(head, lens, cached, fuse=fuse)
    kv_c = [b.clone() for b in kv]
    h_c, logits_c, greedy_c = forward(ids, states, positions, [(b, cached, m) for b, m in zip(kv_c, lens)], fuse)
    heads = [HeadState(b.clone(), n=cached) for b in kv]
    h_t, logits_t, greedy_t = _torch_forward(head, table, ids, states, positions,
                                             [(st, cached, m) for st, m in zip(heads, lens)], fuse)
    torch.testing.assert_close(h_c, h_t, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(logits_c, logits_t, rtol=2e-3, atol=2e-3)
    assert greedy_c == greedy_t
    for b_c, st, b, m in zip(kv_c, heads, kv, lens):
        torch.testing.assert_close(b_c[:, :cached + m], st.kv[:, :cached + m], rtol=2e-3, atol=2e-3)
        assert torch.equal(b_c[:, :cached], b[:, :cached])          # rows before: not written
        assert torch.equal(b_c[:, cached + m:], b[:, cached + m:])  # rows after: not written


def test_q8_embedding_rows_give_the_float_tables_bits() -> None:
    """The Q8_0 table (the default model's) is dequantized in the call exactly as
    ``Q8Embedding.__getitem__`` does: the same bits as the fp32 table."""
    head, forward_f32, _ = _head()
    _, forward_q8, _ = _head(q8=True)
    ids, states, positions, kv = _inputs(head, (4, 1), 2, seed=4)
    outs = []
    for forward in (forward_f32, forward_q8):
        bufs = [b.clone() for b in kv]
        outs.append((forward(ids, states, positions, [(b, 2, m) for b, m in zip(bufs, (4, 1))], True), bufs))
    (a, kv_a), (b, kv_b) = outs
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    assert all(torch.equal(x, y) for x, y in zip(kv_a, kv_b))


def test_a_row_is_the_same_alone_or_in_a_batch() -> None:
    """Batch invariance: each segment's output and K/V are bitwise those of the segment run alone."""
    head, forward, _ = _head()
    lens = (4, 1, 7)
    ids, states, positions, kv = _inputs(head, lens, 2, seed=3)
    together = [b.clone() for b in kv]
    h, logits, greedy = forward(ids, states, positions, [(b, 2, m) for b, m in zip(together, lens)], True)
    start = 0
    for s, m in enumerate(lens):
        alone = kv[s].clone()
        rows = slice(start, start + m)
        h1, logits1, greedy1 = forward(ids[rows], states[rows], positions[rows], [(alone, 2, m)], True)
        assert torch.equal(h1[0], h[s]) and torch.equal(logits1[0], logits[s]) and greedy1[0] == greedy[s]
        assert torch.equal(alone, together[s])
        start += m


def test_norm_before_residual() -> None:
    head, forward, table = _head(norm_before_residual=True)
    ids, states, positions, kv = _inputs(head, (3,), 1)
    h_c, logits_c, _ = forward(ids, states, positions, [(kv[0].clone(), 1, 3)], True)
    h_t, logits_t, _ = _torch_forward(head, table, ids, states, positions, [(HeadState(kv[0].clone(), n=1), 1, 3)],
                                      True)
    torch.testing.assert_close(h_c, h_t, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(logits_c, logits_t, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_every_variant_gives_the_scalar_variants_bits(variant, mode, monkeypatch) -> None:
    """The head's call is the decoder forward's row ops and GEMMs, so each kernel variant (AVX-512
    VNNI, AVX-VNNI, AVX2; NEON builds under qemu, tests/test_neon_qemu.py) gives the scalar one's bits."""
    head, forward, _ = _head(mode, q8=True)
    lens = (4, 1, 1)
    ids, states, positions, kv = _inputs(head, lens, 40, seed=9)  # 40 cached rows: key chunks and a tail
    got_kv = [b.clone() for b in kv]
    got = forward(ids, states, positions, [(b, 40, m) for b, m in zip(got_kv, lens)], True)
    use_variant("scalar", monkeypatch)
    want_kv = [b.clone() for b in kv]
    want = forward(ids, states, positions, [(b, 40, m) for b, m in zip(want_kv, lens)], True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2]
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))


def test_bad_arguments_are_refused() -> None:
    """Checked before the C code indexes memory: a segment past its buffer, a buffer of another
    dtype, rows the segments do not cover, states of the wrong width, a position or token id out
    of range."""
    head, forward, _ = _head()
    ids, states, positions, kv = _inputs(head, (2,), 1)
    with pytest.raises(ValueError, match="does not fit"):
        forward(ids, states, positions, [(kv[0], kv[0].shape[1] - 1, 2)], True)
    with pytest.raises(ValueError, match="does not fit"):
        forward(ids, states, positions, [(kv[0].to(torch.float64), 1, 2)], True)
    with pytest.raises(ValueError, match="segments of 1 rows"):
        forward(ids, states, positions, [(kv[0], 1, 1)], True)
    with pytest.raises(ValueError, match="want"):
        forward(ids, states, positions, [(kv[0], 1, 2)], False)   # tap-state width, read as hidden
    with pytest.raises(IndexError, match="positions"):
        forward(ids, states, [0, head.rope().max_pos], [(kv[0], 1, 2)], True)
    with pytest.raises(IndexError, match="token ids"):
        forward([0, head.config.vocab_size], states, positions, [(kv[0], 1, 2)], True)


def test_not_built_where_it_cannot_run() -> None:
    """A head whose linears are not on the C kernels (fp32 target) keeps the torch forward, and so
    does an embedding the call cannot read."""
    head = random_head(1)
    table, _ = _table(head.config)
    assert Eagle3CpuForward.build(head, table) is None
    quantize_head(head, "int8")
    assert Eagle3CpuForward.build(head, table) is not None
    assert Eagle3CpuForward.build(head, table.double()) is None
    assert Eagle3CpuForward.build(head, table[:10]) is None
