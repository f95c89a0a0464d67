"""Row preparation (``logits_processing.prepare_logits``) against a plain per-row reference.

The reference builds each verify row's context explicitly (committed output + drafts[:j]) and
applies every feature to that one row densely, in float64, with the formulas written out; the
engine's version (per-request blocks, sparse penalties) must agree on random inputs.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.worker.logits_processing import prepare_logits
from tokenbudget.engine.worker.sampler import Sampler, SamplingRow

V = 12
EOS = 11


def reference_row(x: torch.Tensor, params: SamplingParams, prompt, output, bad_words, banned,
                  num_output) -> torch.Tensor:
    x = x.double().clone()
    if params.allowed_token_ids:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        x[~keep] = -math.inf
    for w in bad_words:
        if len(w) - 1 <= len(output) and tuple(output[len(output) - (len(w) - 1):]) == tuple(w[:-1]):
            x[w[-1]] = -math.inf
    if num_output < params.min_tokens:
        x[list(banned)] = -math.inf
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    for fn in params.logits_processors or ():
        x = fn(tuple(output), x)
    for v in range(V):
        c = output.count(v)
        if (c or v in prompt) and params.repetition_penalty != 1.0:
            x[v] = x[v] / params.repetition_penalty if x[v] > 0 else x[v] * params.repetition_penalty
        x[v] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    return x


def shift_by_last(output_ids, logits):
    """A context-dependent processor: favour the token after the last one."""
    logits[(output_ids[-1] + 1) % V if output_ids else 0] += 3.0
    return logits


tokens = st.integers(0, V - 1)


@st.composite
def requests(draw):
    kw = dict(temperature=0.0, min_tokens=draw(st.integers(0, 4)), max_tokens=16,
              repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.5])),
              frequency_penalty=draw(st.sampled_from([0.0, -0.5, 1.3])),
              presence_penalty=draw(st.sampled_from([0.0, 0.8, -2.0])),
              logit_bias=draw(st.none() | st.dictionaries(tokens, st.floats(-5, 5), max_size=3)),
              allowed_token_ids=draw(st.none() | st.lists(tokens, min_size=3, max_size=8, unique=True)),
              logits_processors=draw(st.sampled_from([None, [shift_by_last]])))
    prompt = draw(st.lists(tokens, min_size=1, max_size=6))
    output = draw(st.lists(tokens, max_size=6))
    drafts = draw(st.lists(tokens, max_size=4))
    words = tuple(tuple(w) for w in draw(st.lists(st.lists(tokens, min_size=1, max_size=3), max_size=3)))
    return SamplingParams(**kw), prompt, output, drafts, words


@settings(max_examples=150, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=4), st.integers(0, 2**31))
def test_every_row_is_prepared_with_its_own_prefix(reqs, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(p, 0, len(pr) + len(out), list(d), None, len(out), (EOS,), pr, out, w)
            for p, pr, out, d, w in reqs]
    logits = torch.randn(sum(len(d) + 1 for *_, d, _ in reqs), V, generator=g) * 3
    raw = logits.clone()
    got = prepare_logits(logits, rows)
    assert torch.equal(logits, raw)  # the raw rows are kept for logprobs
    r = 0
    for p, prompt, output, drafts, words in reqs:
        for j in range(len(drafts) + 1):
            want = reference_row(raw[r], p, prompt, output + drafts[:j], words, (EOS,), len(output) + j)
            assert torch.allclose(got[r].double(), want, atol=1e-5, rtol=1e-5), (j, got[r], want)
            r += 1


def test_plain_rows_are_not_copied() -> None:
    logits = torch.randn(3, V)
    assert prepare_logits(logits, [SamplingRow(SamplingParams(), 0, 5, [1, 2])]) is logits


def test_greedy_verification_uses_the_prepared_rows() -> None:
    """A frequency penalty turns each row's argmax: the draft that repeats is rejected at the row
    whose prefix already holds it, and the emitted token is that row's prepared argmax."""
    logits = torch.zeros(3, V)
    logits[:, 5] = 2.0
    logits[:, 6] = 1.5
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    out = Sampler()(logits, [SamplingRow(params, 0, 3, [5, 5], None, 0, (), (), [])])
    assert out.token_ids == [[5, 6]]  # row 0: 5 (no history); row 1 sees [5]: 5 -> 1.0 < 6
