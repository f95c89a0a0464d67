"""Public API of the engine on the real default model (SmolLM2-135M, fp32, CPU).

``LLM.generate`` / ``LLM.chat``, the msgspec wire format, ``EngineConfig`` validation, bad input
(clear ValueError, nothing else disturbed, no block leaks), abort, stop strings / stop token ids /
max_tokens / ignore_eos, logprobs and prefix caching. One engine for the whole module; every
test leaves it idle with every KV block free.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from tokenbudget import LLM, Logprob, SamplingParams
from tokenbudget.api.config import EngineConfig
from tokenbudget.api.outputs import GenerateRequest, RequestOutput
from tokenbudget.engine.entrypoints.llm_engine import LLMEngine

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, bounded, default_target  # noqa: E402

# ---------------------------------------------------------------- fixtures

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village, there lived an old man who"]


@pytest.fixture(scope="module")
def llm():
    return LLM(default_target(), **ENGINE_OPTS)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """Greedy tokens of each prompt (12 tokens, EOS ignored), computed once."""
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_to_end(engine: LLMEngine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    for _ in bounded(engine.has_unfinished_requests):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.scheduler.check_integrity()
    return final


# ---------------------------------------------------------------- generate / chat


def test_outputs_in_input_order(llm, reference) -> None:
    # Different max_tokens so the requests finish in a different order than they were given.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 3, 7)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for out, n, ref in zip(outs, (12, 3, 7), reference):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == ref[:n]
        assert out.outputs[0].text == llm.tokenizer.decode(ref[:n])
    assert_all_blocks_free(llm.engine)


def test_generate_accepts_token_ids_and_dicts(llm, reference) -> None:
    ids = llm.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    a, b = llm.generate([ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert a.prompt is None and a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == reference[0]


def test_chat(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6)
    conv = [{"role": "user", "content": "Say hi"}]
    (one,) = llm.chat(conv, params, use_tqdm=False)
    assert one.prompt.endswith("<|im_start|>assistant\n") and "Say hi" in one.prompt
    assert one.outputs[0].text and one.outputs[0].finish_reason in ("stop", "length")
    two = llm.chat([conv, [{"role": "user", "content": "Count to three."}]], params, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one.outputs[0].token_ids
    assert "Count to three." in two[1].prompt
    assert_all_blocks_free(llm.engine)


# ---------------------------------------------------------------- wire format


def test_request_output_and_generate_request_round_trip(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, stop=["zzz"], seed=3)
    (out,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert out.outputs[0].logprobs and out.metrics is not None
    for enc, dec in ((msgspec.json.encode, msgspec.json.decode),
                     (msgspec.msgpack.encode, msgspec.msgpack.decode)):
        back = dec(enc(out), type=RequestOutput)
        assert back == out
        assert all(isinstance(t, int) for e in back.outputs[0].logprobs for t in e)
        req = GenerateRequest(request_id="r1", prompt="hi", sampling_params=params, priority=2)
        assert dec(enc(req), type=GenerateRequest) == req
        req2 = GenerateRequest(request_id="r2", prompt_token_ids=[1, 2, 3])
        assert dec(enc(req2), type=GenerateRequest) == req2
    # Bad sampling params on the wire fail loudly, naming the field.
    bad = b'{"request_id": "x", "prompt": "hi", "sampling_params": {"top_p": 0}}'
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.json.decode(bad, type=GenerateRequest)


# ---------------------------------------------------------------- EngineConfig


@pytest.mark.parametrize("field,value", [
    ("block_size", 0), ("kv_cache_memory_bytes", -1), ("max_num_seqs", True),
    ("max_num_batched_tokens", 1.5), ("max_model_len", 0), ("num_threads", -2),
    ("dtype", "float64"), ("device", "tpu"), ("scheduling_policy", "lifo"),
    ("long_prefill_token_threshold", -1), ("speculative_config", "ngram"),
])
def test_engine_config_bad_value_names_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_unknown_engine_option_is_named() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        LLM(max_batch_size=4)  # fails before any model is loaded
    with pytest.raises(ValueError, match="either"):
        LLMEngine(EngineConfig(), num_threads=1)


# ---------------------------------------------------------------- bad input


def _bad_inputs(engine: LLMEngine, running_id: str):
    vocab = engine.model_config.vocab_size
    too_long = [1] * (engine.max_model_len + 1)
    return [
        ("empty", lambda: engine.add_request("bad-empty", "", GREEDY), "empty"),
        ("empty-ids", lambda: engine.add_request("bad-empty-ids", [], GREEDY), "empty"),
        ("too-long", lambda: engine.add_request("bad-long", too_long, GREEDY), "max_model_len"),
        ("vocab", lambda: engine.add_request("bad-vocab", [1, vocab, 2], GREEDY), "out of range"),
        ("negative-id", lambda: engine.add_request("bad-neg", [1, -1], GREEDY), "out of range"),
        ("temperature", lambda: SamplingParams(temperature=-0.5), "temperature"),
        ("top_p", lambda: SamplingParams(top_p=0.0), "top_p"),
        ("params-type", lambda: engine.add_request("bad-type", "hi", {"temperature": 0}), "SamplingParams"),
        ("abort-unknown", lambda: engine.abort_request("no-such-request"), "unknown request_id"),
        ("duplicate", lambda: engine.add_request(running_id, "hello", GREEDY), "duplicate"),
    ]


def test_bad_input_raises_and_disturbs_nothing(llm, reference) -> None:
    engine = llm.engine
    engine.add_request("victim", PROMPTS[2], GREEDY)
    engine.step()  # in flight: prompt computed, first token out
    bad = _bad_inputs(engine, "victim")
    assert len(bad) < GREEDY.max_tokens - 1  # the victim is still running for every one of them
    for name, call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()
        assert engine.get_num_unfinished_requests() == 1, name
        engine.scheduler.check_integrity()
        assert not any(o.finished for o in engine.step()), name
    assert engine.abort_request("no-such-request", missing_ok=True) is None
    final = run_to_end(engine)
    assert list(final) == ["victim"]
    assert final["victim"].outputs[0].token_ids == reference[2]
    assert_all_blocks_free(engine)


def test_generate_with_one_bad_prompt_queues_nothing(llm) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    assert_all_blocks_free(llm.engine)


def test_abort_mid_run_frees_blocks(llm, reference) -> None:
    engine = llm.engine
    engine.add_request("keep", PROMPTS[0], GREEDY)
    engine.add_request("drop", PROMPTS[2], GREEDY)
    for _ in range(3):
        engine.step()
    held = engine.scheduler.kv.num_blocks_held("drop")
    assert held > 0
    free_before = engine.scheduler.kv.num_free_blocks
    out = engine.abort_request("drop")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert 0 < len(out.outputs[0].token_ids) < GREEDY.max_tokens
    assert out.outputs[0].token_ids == reference[2][:len(out.outputs[0].token_ids)]
    assert engine.scheduler.kv.num_free_blocks == free_before + held
    with pytest.raises(ValueError, match="unknown request_id"):
        engine.abort_request("drop")
    final = run_to_end(engine)
    assert list(final) == ["keep"] and final["keep"].outputs[0].token_ids == reference[0]
    assert_all_blocks_free(engine)


# ---------------------------------------------------------------- stopping


def test_stop_conditions(llm, reference) -> None:
    ref_ids = reference[2]
    ref_text = llm.tokenizer.decode(ref_ids)
    # A stop string from the middle of the reference text (not at its very start).
    words = ref_text.split()
    stop = words[len(words) // 2]
    cut = ref_text.index(stop, 1)
    stop_tok = ref_ids[5]
    first = ref_ids.index(stop_tok)
    p = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(**p, stop=[stop, "\u2603never"]),
        SamplingParams(**p, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(**p, stop_token_ids=[stop_tok]),
        SamplingParams(**dict(p, max_tokens=5)),
    ]
    outs = llm.generate([PROMPTS[2]] * len(params), params, use_tqdm=False)
    s, s_inc, tok, length = (o.outputs[0] for o in outs)
    assert (s.finish_reason, s.stop_reason) == ("stop", stop)
    assert s.text == ref_text[:cut]
    assert (s_inc.finish_reason, s_inc.stop_reason) == ("stop", stop)
    assert s_inc.text == ref_text[:cut + len(stop)]
    assert (tok.finish_reason, tok.stop_reason) == ("stop", stop_tok)
    assert tok.token_ids == ref_ids[:first + 1]
    assert (length.finish_reason, length.stop_reason) == ("length", None)
    assert length.token_ids == ref_ids[:5]
    assert_all_blocks_free(llm.engine)


def test_eos_and_ignore_eos(llm) -> None:
    eos = llm.tokenizer.eos_token_id
    conv = [{"role": "user", "content": "Say hi"}]
    (natural,) = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    c = natural.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", None), "pick a prompt that ends with EOS"
    assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
    n = len(c.token_ids) + 3
    (ignored,) = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                          use_tqdm=False)
    g = ignored.outputs[0]
    assert g.finish_reason == "length" and len(g.token_ids) == n
    assert g.token_ids[:len(c.token_ids)] == c.token_ids
    assert_all_blocks_free(llm.engine)


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("n", [0, 3])
def test_logprobs(llm, reference, n) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=n)
    (out,) = llm.generate(PROMPTS[1], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == reference[1][:6]
    assert len(c.logprobs) == len(c.token_ids)
    total = 0.0
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry
        # greedy: the sampled token is the most likely, so it is among the top n (no extra entry)
        assert len(entry) == max(n, 1)
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        values = [lp.logprob for lp in entry.values()]
        assert entry[tok].logprob == max(values) and entry[tok].logprob <= 0.0 and entry[tok].rank == 1
        assert all(math.isfinite(v) for v in values)
        assert [lp.rank for lp in entry.values()] == list(range(1, len(entry) + 1))
        assert entry[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    (plain,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_logprobs_of_sampled_tokens_are_raw_model_logprobs(llm) -> None:
    params = SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=6, ignore_eos=True, logprobs=5)
    (out,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert tok in entry and len(entry) == 5  # top_k=5: the sampled token is one of the top 5
        assert math.fsum(math.exp(v.logprob) for v in entry.values()) <= 1.0 + 1e-5
        assert 1 <= entry[tok].rank <= 5


# ---------------------------------------------------------------- prefix caching


def test_prefix_caching_hits_and_keeps_output(llm) -> None:
    prompt = ("You are a careful assistant. Read the following notes and answer briefly. "
              "Notes: the red house is next to the blue house; the green house has a cat; "
              "the blue house has two dogs and a parrot; the yellow house is empty. "
              "Question: which house has a parrot? Answer:")
    assert len(llm.tokenizer.encode(prompt)) > 3 * llm.engine.config.block_size
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (first,) = llm.generate(prompt, params, use_tqdm=False)
    (second,) = llm.generate(prompt, params, use_tqdm=False)
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens > 0
    assert second.metrics.num_cached_tokens % llm.engine.config.block_size == 0
    assert second.metrics.num_cached_tokens < len(second.prompt_token_ids)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].text == first.outputs[0].text
    assert_all_blocks_free(llm.engine)
