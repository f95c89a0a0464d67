"""Triton rejection sampler == torch reference, bit for bit (token ids).

Without CUDA the kernel runs under Triton's interpreter in a child process (the variable
``TRITON_INTERPRET=1`` must be set before triton decorates a kernel and must not leak into
the rest of the suite); with CUDA the same checks also run in-process on the GPU. Skips when
triton is not installed.
"""

from __future__ import annotations

import pytest
import torch

from tokenbudget.kernels.rejection_ref import rejection_sample_reference
from tokenbudget.kernels.rejection_triton import rejection_sample

from triton_interp import needs_cuda, needs_triton, run_interpreted  # noqa: E402


def _run_interpreted(func_name: str, *args) -> None:
    run_interpreted(__file__, globals(), func_name, *args)


def _make_inputs(seed: int, num_reqs: int, vocab: int, max_k: int, *, with_draft_probs: bool,
                 greedy_frac: float):
    """Random verify batch with acceptances, rejections, zero-prob tokens, p == q rows and ties."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, max_k + 1, (num_reqs,), generator=g)
    num_rows, num_drafts = int(k.sum()) + num_reqs, int(k.sum())
    logits = torch.randn(num_rows, vocab, generator=g) * 3
    top = torch.rand(num_rows, generator=g) < 0.3  # some rows top-k truncated: zeros in p
    thresh = logits.topk(min(5, vocab), dim=1).values[:, -1:]
    logits = torch.where(top[:, None] & (logits < thresh), float("-inf"), logits)
    flat = torch.rand(num_rows, generator=g) < 0.15  # some rows uniform over 4 tokens: ties
    logits[flat] = float("-inf")
    logits[flat, :4] = 0.0
    target_probs = torch.softmax(logits, dim=1)
    target_argmax = logits.argmax(dim=1)
    row_starts = torch.cumsum(k, 0) - k + torch.arange(num_reqs)
    draft_rows = torch.cat([row_starts[i] + torch.arange(int(k[i])) for i in range(num_reqs)]
                           ) if num_drafts else torch.zeros(0, dtype=torch.int64)
    sampled = torch.multinomial(target_probs[draft_rows], 1, generator=g).squeeze(1) \
        if num_drafts else torch.zeros(0, dtype=torch.int64)
    use_argmax = torch.rand(num_drafts, generator=g) < 0.6
    draft_ids = torch.where(use_argmax, target_argmax[draft_rows], sampled)
    draft_probs = None
    if with_draft_probs:
        draft_probs = torch.softmax(torch.randn(num_drafts, vocab, generator=g) * 2, dim=1)
        # p == q with p(x) == 0: rejected, and max(p - q, 0) == 0 everywhere (the fallback to p)
        same = torch.rand(num_drafts, generator=g) < 0.35
        target_probs[draft_rows[same], draft_ids[same]] = 0.0
        draft_probs[same] = target_probs[draft_rows[same]]
    is_greedy = torch.rand(num_reqs, generator=g) < greedy_frac
    uniforms = torch.rand(num_drafts, generator=g)
    exp_noise = -torch.log(torch.rand(num_reqs, vocab, generator=g))
    exp_noise[torch.rand(num_reqs, vocab, generator=g) < 0.01] = 0.0
    exp_noise[:, :4] = torch.where(torch.rand(num_reqs, 1, generator=g) < 0.3, 1.0, exp_noise[:, :4])
    return (target_probs, target_argmax, draft_ids, k, draft_probs, is_greedy, uniforms, exp_noise)


_CONFIGS = [
    # (seed, reqs, vocab, max_k, draft_probs, greedy fraction)
    (0, 6, 50, 3, False, 0.5),
    (1, 8, 300, 4, True, 0.3),
    (2, 5, 129, 0, False, 0.0),   # plain sampling: no drafts
    (3, 7, 200, 5, True, 1.0),    # all greedy
    (4, 9, 257, 2, False, 0.0),
    (5, 1, 64, 6, True, 0.0),
    (6, 16, 40, 1, True, 0.0),    # many first-position rejections: hits the p == q fallback
]


def _check_rejection(device: str) -> None:
    from tokenbudget.kernels.rejection_triton import rejection_sample_triton

    for cfg in _CONFIGS:
        seed, reqs, vocab, max_k, with_dp, gfrac = cfg
        args = [a.to(device) if a is not None else None
                for a in _make_inputs(seed, reqs, vocab, max_k, with_draft_probs=with_dp,
                                      greedy_frac=gfrac)]
        want = rejection_sample_reference(*args)
        for block_v in (64, 1024):  # several tiles and a single tile
            got = rejection_sample_triton(*args, block_v=block_v)
            assert torch.equal(got, want), f"cfg {cfg} block_v {block_v}:\n{got}\n{want}"
        if gfrac == 1.0:  # greedy-only call without probabilities or noise
            probs_free = [None, args[1], args[2], args[3], None, args[5], args[6], None]
            got = rejection_sample_triton(*probs_free)
            assert torch.equal(got, rejection_sample_reference(*probs_free)), f"cfg {cfg} greedy-only"


def test_dispatch_on_cpu_is_reference():
    args = _make_inputs(0, 4, 40, 3, with_draft_probs=True, greedy_frac=0.5)
    assert torch.equal(rejection_sample(*args), rejection_sample_reference(*args))


@needs_triton
def test_triton_rejection_interpreter_matches_reference():
    _run_interpreted("_check_rejection", "cpu")


@pytest.mark.cuda
@needs_triton
@needs_cuda
def test_triton_rejection_cuda_matches_reference():
    _check_rejection("cuda")
