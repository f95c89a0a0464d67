"""vLLM's sampling features on the real default model, against transformers, with and without speculation.

Each feature runs greedy on two repetitive prompts (so n-gram / suffix drafters propose, and
penalties and bad words reject many drafts) and is compared token for token with a step-by-step
loop over transformers' logits of the same weights, processed by transformers' own processors
where they exist (``RepetitionPenaltyLogitsProcessor``, ``NoBadWordsLogitsProcessor``,
``SequenceBiasLogitsProcessor``, ``PrefixConstrainedLogitsProcessor``) and by the OpenAI formula
for presence / frequency penalties. Every reference step's top-2 gap is checked to be far above
the float noise between the two implementations, so a mismatch is a bug, not a near tie. Then
the same batch under ngram, suffix and draft_model speculation must give the same tokens, and
prompt / sample logprobs must equal transformers' log_softmax within 1e-4.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

from tokenbudget import LLM, SamplingParams

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, default_loaded, default_target  # noqa: E402
from model_helpers import hf_gguf_tokenizer, hf_llama_from_loaded  # noqa: E402

PROMPTS = ["Repeat after me: red green blue, red green blue, red green blue, red green blue,",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef"]
MAX_TOKENS = 10
MIN_GAP = 1e-3  # smallest top-2 logit gap of a reference step (float noise is ~1e-5)
BIAS = {4461: -3.0, 28: 2.5, 803: 4.0}  # ' blue' down, ',' and ' add' up
ALLOWED = [2382, 2654, 4461, 28, 803, 24, 81, 253, 1003, 278, 198]
BAD_WORDS = [" green blue", "return"]


def no_repeat(output_ids, logits):
    """A logits processor of the output so far: never the same token twice in a row."""
    if output_ids:
        logits[output_ids[-1]] = float("-inf")
    return logits


def echo_prompt_end(prompt_ids, output_ids, logits):
    """The three-argument form: favour the prompt's last token, more as the output grows."""
    logits[prompt_ids[-1]] += 1.5 * len(output_ids)
    return logits


FEATURES = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "frequency_presence": dict(frequency_penalty=2.0, presence_penalty=1.5),
    "logit_bias": dict(logit_bias=BIAS),
    "allowed_token_ids": dict(allowed_token_ids=ALLOWED),
    "bad_words": dict(bad_words=BAD_WORDS),
    "logits_processors": dict(logits_processors=[no_repeat, echo_prompt_end]),
    "combined": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, logit_bias=BIAS,
                     bad_words=BAD_WORDS, logits_processors=[echo_prompt_end]),
}
CASES = [(f, p) for f in FEATURES for p in range(len(PROMPTS))]


def params_of(feature: str, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **FEATURES[feature], **extra)


# ---------------------------------------------------------------- the reference


def bad_word_ids(tokenizer) -> list[list[int]]:
    """vLLM's rule: each word as written, and with a leading space when that is a new first
    token of the same length."""
    out = []
    for w in BAD_WORDS:
        plain = tokenizer.encode(w.lstrip())
        spaced = tokenizer.encode(" " + w.lstrip())
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def reference_processor(feature: str, tokenizer):
    """(prompt ids, output ids, raw logits [V]) -> processed logits, with transformers' processors."""
    kw = FEATURES[feature]
    lp = transformers.generation.logits_process
    bad = lp.NoBadWordsLogitsProcessor(bad_word_ids(tokenizer), eos_token_id=None) if "bad_words" in kw else None
    bias = (lp.SequenceBiasLogitsProcessor({(t,): b for t, b in kw["logit_bias"].items()})
            if "logit_bias" in kw else None)
    allowed = (lp.PrefixConstrainedLogitsProcessor(lambda _b, _ids: kw["allowed_token_ids"], num_beams=1)
               if "allowed_token_ids" in kw else None)
    rep = lp.RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]) if "repetition_penalty" in kw else None

    def process(prompt: list[int], output: list[int], x: torch.Tensor) -> torch.Tensor:
        x = x[None].clone()
        if allowed is not None:
            x = allowed(torch.tensor([prompt + output]), x)
        if bad is not None:  # vLLM matches bad words against the output only
            x = bad(torch.tensor([output], dtype=torch.long), x)
        if bias is not None:
            x = bias(torch.tensor([prompt + output]), x)
        for fn in kw.get("logits_processors", []):
            x[0] = fn(tuple(prompt), tuple(output), x[0]) if fn is echo_prompt_end else fn(tuple(output), x[0])
        if rep is not None:
            x = rep(torch.tensor([prompt + output]), x)
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.shape[1]).float()
        x[0] -= kw.get("frequency_penalty", 0.0) * counts + kw.get("presence_penalty", 0.0) * (counts > 0).float()
        return x[0]
    return process


def reference_greedy(hf, prompt: list[int], process) -> tuple[list[int], float]:
    """transformers, one token at a time (KV cache), each step's logits through ``process``;
    the tokens and the smallest top-2 gap seen."""
    out: list[int] = []
    gap = float("inf")
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"  # 5.x / 4.x
    with torch.no_grad():
        res = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(MAX_TOKENS):
            x = process(prompt, out, res.logits[0, -1].float())
            top = x.topk(2).values
            gap = min(gap, float(top[0] - top[1]))
            out.append(int(x.argmax()))
            cache = res["cache"] if "cache" in res else res.past_key_values
            res = hf(torch.tensor([[out[-1]]]), use_cache=True, **{cache_arg: cache})
    return out, gap


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hf():
    return hf_llama_from_loaded(default_loaded())


@pytest.fixture(scope="module")
def llm():
    return LLM(default_target(), **ENGINE_OPTS)


def run_all(llm: LLM) -> dict[tuple[str, int], list[int]]:
    outs = llm.generate([PROMPTS[p] for _, p in CASES], [params_of(f) for f, _ in CASES], use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    return {case: list(o.outputs[0].token_ids) for case, o in zip(CASES, outs)}


@pytest.fixture(scope="module")
def plain(llm):
    return run_all(llm)


@pytest.fixture(scope="module")
def unprocessed(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("feature", list(FEATURES))
def test_greedy_equals_transformers_step_loop(feature, plain, unprocessed, hf, llm) -> None:
    process = reference_processor(feature, hf_gguf_tokenizer())  # bad words as transformers tokenizes them
    for p, prompt in enumerate(PROMPTS):
        ids = hf_gguf_tokenizer()(prompt).input_ids  # transformers' own tokenization, not ours
        want, gap = reference_greedy(hf, ids, process)
        assert gap > MIN_GAP, f"{feature}: a near tie ({gap:.2e}) makes this prompt unfit"
        assert plain[(feature, p)] == want, f"{feature}, prompt {p}"
    assert any(plain[(feature, p)] != unprocessed[p] for p in range(len(PROMPTS))), "the feature changed nothing"


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},  # the default model drafts itself
}


@pytest.mark.parametrize("method", list(SPECS))
def test_speculation_gives_identical_greedy_tokens(method, plain) -> None:
    spec = dict(SPECS[method])
    if method == "draft_model":
        from tokenbudget.engine.loader.default_model import default_model_path
        spec["model"] = default_model_path()
    llm = LLM(default_target(), **ENGINE_OPTS, speculative_config=spec)
    assert run_all(llm) == plain
    stats = llm.get_spec_stats()
    assert stats.num_accepted_tokens > 0  # rows after accepted drafts were used
    if method == "draft_model":  # the target drafting itself, with the same row preparation
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:  # the prepared rows rejected some of the text-copying drafts
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_prompt_and_sample_logprobs_equal_transformers(llm, hf) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                            repetition_penalty=1.3)  # logprobs stay the raw model's
    (out,) = llm.generate(PROMPTS[1], params, use_tqdm=False)
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    plp = out.prompt_logprobs
    assert len(plp) == len(out.prompt_token_ids) and plp[0] is None
    entries = plp[1:] + out.outputs[0].logprobs
    for pos, (tok, entry) in enumerate(zip(ids[1:], entries)):
        row, k = want[pos], (2 if pos < len(plp) - 1 else 3)
        top = row.topk(k).indices.tolist()
        assert list(entry)[0] == tok and set(entry) == {tok, *top}
        for t, e in entry.items():
            assert e.logprob == pytest.approx(float(row[t]), abs=1e-4)
            assert e.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
        assert sorted(entry[t].rank for t in top) == list(range(1, k + 1))
        # rank: 1 + the tokens more likely (a margin for the float noise between the two models)
        assert int((row > row[tok] + 1e-4).sum()) + 1 <= entry[tok].rank <= int((row >= row[tok] - 1e-4).sum())
    assert_all_blocks_free(llm.engine)


def test_prompt_logprobs_survive_chunked_prefill_and_skip_the_prefix_cache(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    (whole,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    chunked = LLM(default_target(), **dict(ENGINE_OPTS, max_num_batched_tokens=7))
    chunked.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # fills the cache
    (again,) = chunked.generate(PROMPTS[0], params, use_tqdm=False)
    assert again.metrics.num_cached_tokens == 0  # every prompt position computed
    assert [None if e is None else sorted(e) for e in again.prompt_logprobs] == \
        [None if e is None else sorted(e) for e in whole.prompt_logprobs]
    for a, b in zip(again.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    assert_all_blocks_free(chunked.engine)
