"""The EAGLE-3 head's C forward (``engine.model.eagle3_cpu``, ``tb_eagle3``) against the head's
torch forward on the same quantized weights: the same outputs and K/V up to float rounding, rows
computed from themselves alone (the same bits in any batch), nothing written outside a segment's
rows, and bad arguments refused before the C code touches memory."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.engine.model.eagle3_cpu import Eagle3CpuForward, quantize_head
from tokenbudget.engine.worker.eagle3_kv import HeadState, segment_attend
from tokenbudget.kernels.cpu.native import library, unavailable_reason

from eagle3_fixtures import random_head
from native_variants import use_variant

pytestmark = pytest.mark.skipif(library() is None, reason=f"no C kernels: {unavailable_reason()}")


def _head(mode: str = "int8", **overrides):
    head = random_head(5, **overrides)
    quantize_head(head, mode)
    forward = Eagle3CpuForward.build(head)
    assert forward is not None
    return head, forward


def _inputs(head, lens, cached: int, seed: int = 0):
    c = head.config
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    embeds = torch.randn(n, c.hidden_size, generator=gen)
    hidden = torch.randn(n, c.hidden_size, generator=gen)
    positions = torch.cat([torch.arange(m) + cached + 2 * i for i, m in enumerate(lens)])
    kv = [torch.randn(2, cached + m + 5, c.num_key_value_heads, c.head_dim, generator=gen) for m in lens]
    return embeds, hidden, positions, kv


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("lens", [(1,), (1, 1, 1), (6,), (5, 1, 9)])
def test_matches_the_torch_forward(mode, lens) -> None:
    """Catch-up segments (many rows, only the last queries) and draft steps (one row each), after 3
    cached rows: outputs and every written K/V row agree with the torch forward; the rows after
    the segment are untouched."""
    head, forward = _head(mode)
    cached = 3
    embeds, hidden, positions, kv = _inputs(head, lens, cached)
    kv_c = [b.clone() for b in kv]
    h_c, logits_c = forward(embeds, hidden, positions, [(b, cached, m) for b, m in zip(kv_c, lens)])

    states = [HeadState(b.clone(), n=cached) for b in kv]
    last = torch.tensor(lens).cumsum(0) - 1
    with torch.inference_mode():
        h_t, logits_t = head(embeds, hidden, positions, segment_attend([(st, cached, m) for st, m in zip(states, lens)],
                                                                         last_only=True), out_rows=last)
    torch.testing.assert_close(h_c, h_t, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(logits_c, logits_t, rtol=2e-3, atol=2e-3)
    for b_c, st, b, m in zip(kv_c, states, kv, lens):
        torch.testing.assert_close(b_c[:, :cached + m], st.kv[:, :cached + m], rtol=2e-3, atol=2e-3)
        assert torch.equal(b_c[:, :cached], b[:, :cached])          # rows before: not written
        assert torch.equal(b_c[:, cached + m:], b[:, cached + m:])  # rows after: not written


def test_a_row_is_the_same_alone_or_in_a_batch() -> None:
    """Batch invariance: each segment's output and K/V are bitwise those of the segment run alone."""
    head, forward = _head()
    lens = (4, 1, 7)
    embeds, hidden, positions, kv = _inputs(head, lens, 2, seed=3)
    together = [b.clone() for b in kv]
    h, logits = forward(embeds, hidden, positions, [(b, 2, m) for b, m in zip(together, lens)])
    start = 0
    for s, m in enumerate(lens):
        alone = kv[s].clone()
        rows = slice(start, start + m)
        h1, logits1 = forward(embeds[rows], hidden[rows], positions[rows], [(alone, 2, m)])
        assert torch.equal(h1[0], h[s]) and torch.equal(logits1[0], logits[s])
        assert torch.equal(alone, together[s])
        start += m


def test_norm_before_residual() -> None:
    head, forward = _head(norm_before_residual=True)
    embeds, hidden, positions, kv = _inputs(head, (3,), 1)
    h_c, logits_c = forward(embeds, hidden, positions, [(kv[0].clone(), 1, 3)])
    st = HeadState(kv[0].clone(), n=1)
    with torch.inference_mode():
        h_t, logits_t = head(embeds, hidden, positions, segment_attend([(st, 1, 3)], last_only=True),
                             out_rows=torch.tensor([2]))
    torch.testing.assert_close(h_c, h_t, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(logits_c, logits_t, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_every_variant_gives_the_scalar_variants_bits(variant, mode, monkeypatch) -> None:
    """The head's call is the decoder forward's row ops and GEMMs, so each kernel variant (AVX-512
    VNNI, AVX-VNNI, AVX2; NEON builds under qemu, tests/test_neon_qemu.py) gives the scalar one's bits."""
    head, forward = _head(mode)
    lens = (4, 1, 1)
    embeds, hidden, positions, kv = _inputs(head, lens, 40, seed=9)  # 40 cached rows: key chunks and a tail
    got_kv = [b.clone() for b in kv]
    got = forward(embeds, hidden, positions, [(b, 40, m) for b, m in zip(got_kv, lens)])
    use_variant("scalar", monkeypatch)
    want_kv = [b.clone() for b in kv]
    want = forward(embeds, hidden, positions, [(b, 40, m) for b, m in zip(want_kv, lens)])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))


def test_bad_arguments_are_refused() -> None:
    head, forward = _head()
    embeds, hidden, positions, kv = _inputs(head, (2,), 1)
    with pytest.raises(ValueError, match="does not fit"):
        forward(embeds, hidden, positions, [(kv[0], kv[0].shape[1] - 1, 2)])   # past the buffer
    with pytest.raises(ValueError, match="does not fit"):
        forward(embeds, hidden, positions, [(kv[0].to(torch.float64), 1, 2)])
    with pytest.raises(ValueError, match="segments cover"):
        forward(embeds, hidden, positions, [(kv[0], 1, 1)])
    with pytest.raises(IndexError, match="positions"):
        forward(embeds, hidden, torch.tensor([0, head.rope().max_pos]), [(kv[0], 1, 2)])


def test_not_built_for_a_float_head() -> None:
    """A head whose linears are not on the C kernels (fp32 target) keeps the torch forward."""
    assert Eagle3CpuForward.build(random_head(1)) is None
