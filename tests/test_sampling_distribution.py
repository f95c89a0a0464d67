"""Sampled outputs with penalties and logit bias keep the target's distribution under speculation.

A random Llama with a 16-token vocabulary (so the exact distribution of two tokens is a 256-cell
table) samples 3 tokens per request with presence, frequency and repetition penalties and a
logit bias. With a draft model and no seed the verify step uses classic rejection sampling, and
with 3 tokens the second step verifies one draft: its bonus row predicts token 3 from a context
that holds the draft, so the penalties must count it there. The empirical joint distribution of
tokens 2 and 3 is compared (chi-square) with the exact one computed from transformers' logits of
the same weights (bias, ``RepetitionPenaltyLogitsProcessor``, OpenAI presence / frequency).
Seeded requests must give exactly the tokens of plain decoding (n-gram and suffix drafters, which
rarely match a random model, are checked the same way on the default model in
test_sampling_requests.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from scipy.stats import chisquare

from tokenbudget import LLM, SamplingParams

from tiny_llama import make_tiny_llama, make_truncated_copy  # noqa: E402

VOCAB = 16
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]
N = 3000
KW = dict(temperature=1.0, max_tokens=3, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.6,
          repetition_penalty=1.8, logit_bias={3: 1.5, 5: -2.0, 9: 1.0})
OPTS = dict(num_threads=1, kv_cache_memory_bytes=16 << 20, max_num_seqs=256)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    target = make_tiny_llama(root / "target", layers=2, hidden=32, vocab=VOCAB, seed=3, scale=4.0)
    return target, make_truncated_copy(target, root / "draft", layers=1)


def exact_joint(path: str) -> torch.Tensor:
    """[V, V] probability of (token 2, token 3), float64, from transformers' logits."""
    hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    rep = transformers.RepetitionPenaltyLogitsProcessor(KW["repetition_penalty"])
    bias = torch.zeros(VOCAB)
    for t, b in KW["logit_bias"].items():
        bias[t] = b

    def probs(outputs: torch.Tensor) -> torch.Tensor:  # [B, n] outputs after PROMPT -> [B, V]
        ids = torch.cat([torch.tensor(PROMPT).expand(len(outputs), -1), outputs], dim=1)
        with torch.no_grad():
            x = hf(ids).logits[:, -1].double() + bias
        x = rep(ids, x)
        counts = torch.stack([torch.bincount(o, minlength=VOCAB) for o in outputs]).double() if outputs.shape[1] \
            else torch.zeros_like(x)
        x = x - KW["frequency_penalty"] * counts - KW["presence_penalty"] * (counts > 0)
        return x.softmax(-1)

    v = torch.arange(VOCAB)
    p1 = probs(torch.zeros(1, 0, dtype=torch.long))[0]
    p2 = probs(v[:, None])  # [x1, x2]
    pairs = torch.stack(torch.meshgrid(v, v, indexing="ij"), -1).reshape(-1, 2)
    p3 = probs(pairs).reshape(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def test_penalties_and_bias_keep_the_distribution_under_rejection_sampling(dirs) -> None:
    target, draft = dirs
    spec = LLM(target, **OPTS, speculative_config={"method": "draft_model", "model": draft,
                                                   "num_speculative_tokens": 2})
    outs = spec.generate([PROMPT] * N, SamplingParams(**KW), use_tqdm=False)
    stats = spec.get_spec_stats()
    assert stats.num_draft_tokens >= N // 2 and stats.num_accepted_tokens >= N // 4  # the bonus row is used
    observed = torch.zeros(VOCAB, VOCAB)
    for o in outs:
        _, x2, x3 = o.outputs[0].token_ids
        observed[x2, x3] += 1
    expected = exact_joint(target) * N
    small = expected < 5  # pooled into one cell
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    assert int((~small).sum()) >= 20
    _, p = chisquare(obs.numpy(), exp.numpy() * (obs.sum() / exp.sum()).item())
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_seeded_sampling_with_penalties_equals_plain_decoding(dirs) -> None:
    """A seeded request is verified by the coupled rule: the same tokens as plain decoding."""
    target, draft = dirs
    plain = LLM(target, **OPTS)
    spec = LLM(target, **OPTS,
               speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    params = [SamplingParams(**dict(KW, max_tokens=16), seed=s) for s in range(64)]
    want = [o.outputs[0].token_ids for o in plain.generate([PROMPT] * 64, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate([PROMPT] * 64, params, use_tqdm=False)]
    assert got == want
    stats = spec.get_spec_stats()
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
