"""``n``, stop-token text, special tokens, prompt truncation and validation, end to end on the
default model (one shared model, few tokens).

* ``n``: child i of a seeded request equals a single request with ``seed + i`` (vLLM), run alone
  or in one batch, with or without n-gram speculation; children 1.. get the prompt's blocks from
  the prefix cache; LLMEngine steps and AsyncLLM streams carry the completions by index.
* Text: a request ended by a stop token keeps it in ``token_ids`` but not in ``text`` unless
  ``include_stop_str_in_output``; ``skip_special_tokens=False`` shows special tokens.
* A bad value is a ValueError naming the field at ``add_request``, and disturbs no other request.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tokenbudget import LLM, AsyncLLM, EngineConfig, RequestOutputKind, SamplingParams

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, bounded, default_target  # noqa: E402

IM_START, IM_END, COMMA = 1, 2, 28
PROMPT = "Repeat after me: red green blue, red green blue, red green blue, red green blue,"
LONG = ("You are a careful assistant. Read the notes and answer briefly. Notes: the red house is next to the "
        "blue house; the green house has a cat. Question: which house has a cat? Answer:")
SEEDED = SamplingParams(n=3, temperature=0.6, seed=17, max_tokens=12, ignore_eos=True, frequency_penalty=0.1,
                        presence_penalty=0.1, repetition_penalty=1.02, logit_bias={COMMA: 0.5})


@pytest.fixture(scope="module")
def llm():
    return LLM(default_target(), **ENGINE_OPTS)


def tokens(out) -> list[list[int]]:
    return [list(c.token_ids) for c in out.outputs]


# ---------------------------------------------------------------- n


def test_n_children_are_seed_plus_index_and_reproducible(llm) -> None:
    (out,) = llm.generate(PROMPT, SEEDED, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished and out.request_id.startswith("llm-")
    singles = llm.generate([PROMPT] * 3, [msgspec.structs.replace(SEEDED, n=1, seed=17 + i) for i in range(3)],
                           use_tqdm=False)
    assert tokens(out) == [tokens(s)[0] for s in singles]
    assert len({tuple(t) for t in tokens(out)}) > 1  # independent samples
    again = llm.generate([PROMPT, LONG], [SEEDED, SamplingParams(max_tokens=3)], use_tqdm=False)
    assert tokens(again[0]) == tokens(out)
    for method in ("ngram", "suffix"):  # seeded: the coupled rule gives plain decoding's tokens
        spec = LLM(default_target(), **ENGINE_OPTS, speculative_config={"method": method, "num_speculative_tokens": 4})
        (with_spec,) = spec.generate(PROMPT, SEEDED, use_tqdm=False)
        assert tokens(with_spec) == tokens(out)
        assert 0 < with_spec.metrics.num_accepted_tokens < with_spec.metrics.num_draft_tokens
        assert_all_blocks_free(spec.engine)
    assert_all_blocks_free(llm.engine)


def test_n_children_read_the_prompt_from_the_prefix_cache() -> None:
    fresh = LLM(default_target(), **ENGINE_OPTS)
    greedy = SamplingParams(n=4, temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = fresh.generate(LONG, greedy, use_tqdm=False)
    block = fresh.engine.config.block_size
    shared = (len(out.prompt_token_ids) - 1) // block * block
    assert shared >= 2 * block
    assert out.metrics.num_cached_tokens == 3 * shared  # child 0 computed it, children 1..3 reused it
    (single,) = fresh.generate(LONG, msgspec.structs.replace(greedy, n=1), use_tqdm=False)
    assert tokens(out) == tokens(single) * 4
    assert_all_blocks_free(fresh.engine)


def test_n_through_llm_engine_steps_and_abort(llm) -> None:
    engine = llm.engine
    (want,) = llm.generate(PROMPT, SEEDED, use_tqdm=False)
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine.add_request("parent", PROMPT, msgspec.structs.replace(SEEDED, output_kind=kind))
        with pytest.raises(ValueError, match="duplicate"):
            engine.add_request("parent", PROMPT, SEEDED)
        got: dict[int, list[int]] = {}
        last = None
        for _ in bounded(engine.has_unfinished_requests):
            for out in engine.step():
                assert out.request_id == "parent"
                for c in out.outputs:
                    got[c.index] = got.get(c.index, []) + c.token_ids if kind == RequestOutputKind.DELTA \
                        else list(c.token_ids)
                last = out
        assert last.finished and [got[i] for i in range(3)] == tokens(want)
    engine.add_request("doomed", LONG, SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.step()
    final = engine.abort_request("doomed")
    assert final.finished and {c.finish_reason for c in final.outputs} == {"abort"}
    assert_all_blocks_free(engine)


def test_delta_outputs_carry_the_prompt_logprobs_once(llm) -> None:
    """Through ``LLMEngine`` (which, unlike the server and ``AsyncLLM`` streams, hides nothing): a
    DELTA request's prompt logprobs come in its first output only, CUMULATIVE ones in every
    output, FINAL_ONLY in its one output; always the same list (issue 43's survivor: DELTA re-sent
    them every step)."""
    engine = llm.engine
    seen: dict[RequestOutputKind, list] = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1, output_kind=kind)
        engine.add_request(f"r-{kind.name}", PROMPT, params)
        outs = [out for _ in bounded(engine.has_unfinished_requests) for out in engine.step()]
        seen[kind] = [out.prompt_logprobs for out in outs]
    first = seen[RequestOutputKind.DELTA][0]
    assert first is not None and len(first) == len(llm.tokenizer.encode(PROMPT))
    assert len(seen[RequestOutputKind.DELTA]) == 4 and seen[RequestOutputKind.DELTA][1:] == [None] * 3
    assert seen[RequestOutputKind.CUMULATIVE] == [first] * 4
    assert seen[RequestOutputKind.FINAL_ONLY] == [first]
    assert_all_blocks_free(engine)


def test_n_in_async_streams() -> None:
    async def main():
        async_llm = AsyncLLM(default_target(), **ENGINE_OPTS)
        results = {}
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
            got: dict[int, list[int]] = {}
            async for out in async_llm.generate(PROMPT, msgspec.structs.replace(SEEDED, output_kind=kind)):
                for c in out.outputs:
                    got[c.index] = (got.get(c.index, []) + c.token_ids if kind == RequestOutputKind.DELTA
                                    else list(c.token_ids))
            results[kind] = [got[i] for i in range(3)]
        stream = async_llm.add_request("cut", LONG, SamplingParams(n=2, max_tokens=60, ignore_eos=True))
        async for out in stream:  # noqa: B007 (the last output is checked below)
            async_llm.abort("cut")
        assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
        await async_llm.shutdown()
        return results, async_llm
    results, async_llm = asyncio.run(main())
    reference = tokens(LLM(default_target(), **ENGINE_OPTS).generate(PROMPT, SEEDED, use_tqdm=False)[0])
    assert all(r == reference for r in results.values())
    assert_all_blocks_free(async_llm.engine)


# ---------------------------------------------------------------- text


def test_stop_token_text_and_include_stop_str_in_output(llm) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[COMMA])
    cut, kept = llm.generate([PROMPT, PROMPT], [base, msgspec.structs.replace(base, include_stop_str_in_output=True)],
                             use_tqdm=False)
    assert cut.outputs[0].token_ids == kept.outputs[0].token_ids and cut.outputs[0].token_ids[-1] == COMMA
    assert cut.outputs[0].stop_reason == COMMA and cut.outputs[0].finish_reason == "stop"
    assert kept.outputs[0].text == cut.outputs[0].text + "," and not cut.outputs[0].text.endswith(",")


def test_skip_special_tokens(llm) -> None:
    forced = dict(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={IM_START: 100})
    skipped, shown = llm.generate([PROMPT, PROMPT], [SamplingParams(**forced),
                                                     SamplingParams(**forced, skip_special_tokens=False)],
                                  use_tqdm=False)
    assert skipped.outputs[0].token_ids == [IM_START, IM_START] == shown.outputs[0].token_ids
    assert skipped.outputs[0].text == "" and shown.outputs[0].text == "<|im_start|><|im_start|>"
    eos = dict(temperature=0.0, max_tokens=4, logit_bias={IM_END: 100}, skip_special_tokens=False)
    dropped, included = llm.generate([PROMPT, PROMPT], [SamplingParams(**eos),
                                                        SamplingParams(**eos, include_stop_str_in_output=True)],
                                     use_tqdm=False)
    assert dropped.outputs[0].token_ids == [IM_END] and dropped.outputs[0].finish_reason == "stop"
    assert dropped.outputs[0].text == "" and included.outputs[0].text == "<|im_end|>"


def test_truncate_prompt_tokens(llm) -> None:
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    cut, direct = llm.generate([PROMPT, ids[-6:]], [msgspec.structs.replace(greedy, truncate_prompt_tokens=6), greedy],
                               use_tqdm=False)
    assert cut.prompt_token_ids == ids[-6:] and tokens(cut) == tokens(direct)
    (whole,) = llm.generate(PROMPT, msgspec.structs.replace(greedy, truncate_prompt_tokens=-1), use_tqdm=False)
    assert whole.prompt_token_ids == ids


# ---------------------------------------------------------------- validation


def test_bad_values_raise_naming_the_field_and_disturb_nothing(llm) -> None:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.2)
    (want,) = llm.generate(PROMPT, greedy, use_tqdm=False)
    engine.add_request("good", PROMPT, greedy)
    engine.step()
    bad = [("logit_bias", dict(logit_bias={vocab: 1.0})), ("allowed_token_ids", dict(allowed_token_ids=[0, vocab])),
           ("logprobs", dict(logprobs=21)), ("prompt_logprobs", dict(prompt_logprobs=-1)),
           ("stop_token_ids", dict(stop_token_ids=[vocab + 5])),
           ("truncate_prompt_tokens", dict(truncate_prompt_tokens=engine.max_model_len + 1))]
    for field, kw in bad:
        with pytest.raises(ValueError, match=field):
            engine.add_request(f"bad-{field}", PROMPT, SamplingParams(**kw))
    for field, kw in [("n", dict(n=0)), ("presence_penalty", dict(presence_penalty=3)),
                      ("repetition_penalty", dict(repetition_penalty=0)), ("bad_words", dict(bad_words=[""]))]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineConfig(max_logprobs=-2)

    def broken(output_ids, logits):
        raise RuntimeError("a user processor failed")
    engine.add_request("faulty", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, logits_processors=[broken]))
    outs = {}
    for _ in bounded(engine.has_unfinished_requests):
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["good"].outputs[0].token_ids == want.outputs[0].token_ids
    assert outs["faulty"].outputs[0].finish_reason == "error" and "user processor" in outs["faulty"].error
    assert_all_blocks_free(engine)


def test_max_logprobs_is_an_engine_option() -> None:
    wide = LLM(default_target(), **ENGINE_OPTS, max_logprobs=-1)
    (out,) = wide.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1), use_tqdm=False)
    entry = out.outputs[0].logprobs[0]
    assert len(entry) == wide.engine.model_config.vocab_size
    assert sorted(e.rank for e in entry.values()) == list(range(1, len(entry) + 1))


def test_detokenize_false_and_a_processor_that_forces_tokens(llm) -> None:
    """Two of vLLM's own checks: no text and no decoded tokens without detokenization; a
    processor setting +inf forces that token, even when sampling."""
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=4, detokenize=False, logprobs=3, prompt_logprobs=3),
                          use_tqdm=False)
    c = out.outputs[0]
    assert len(c.token_ids) == 4 and c.text == ""
    for entry in out.prompt_logprobs[1:] + c.logprobs:
        assert 3 <= len(entry) <= 4 and all(lp.decoded_token is None for lp in entry.values())
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"], detokenize=False)

    def pick_ith(token_ids, logits):
        logits[len(token_ids)] = float("inf")
        return logits
    params = SamplingParams(max_tokens=5, seed=1, ignore_eos=True, logits_processors=[pick_ith])
    (forced,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert forced.outputs[0].token_ids == [0, 1, 2, 3, 4]
