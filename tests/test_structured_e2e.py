"""Structured output on the real default model: every output parses and validates, and greedy
(or seeded) text is identical with and without speculation (ngram, suffix; self_draft, a model
drafter with probabilities, in the slow run), also when steps fail and are rolled back.

The prompts carry their schema, as real requests do, so n-gram and suffix drafting find matches
(keys, enum values) and many drafts are verified against grammar masks.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenbudget import LLM, SamplingParams, StructuredOutputsParams

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, default_target
from structured_schemas import MAX_TOKENS, SCHEMAS

SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "self_draft": {"method": "self_draft", "draft_num_layers": 8, "num_speculative_tokens": 3},
}
FAST_SCHEMAS = ("person", "tags", "nested_address", "nullable", "array_of_objects", "weather")


@pytest.fixture(scope="module")
def engines():
    cache: dict = {}

    def get(method: str | None) -> LLM:
        if method not in cache:
            cache[method] = LLM(default_target(), speculative_config=SPECS.get(method), **ENGINE_OPTS)
        return cache[method]
    return get


def _chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def _json_requests(llm: LLM, names, temperature: float = 0.0, seed: int | None = None):
    chosen = [s for s in SCHEMAS if s[0] in names] if names else SCHEMAS
    prompts = [_chat(llm, f"{p}\nReply with JSON matching this schema: {json.dumps(s)}") for _, p, s in chosen]
    params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=s)) for _, _, s in chosen]
    return chosen, prompts, params


def _check_json(llm: LLM, method, names, **kw) -> list[str]:
    chosen, prompts, params = _json_requests(llm, names, **kw)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for (name, _, schema), out in zip(chosen, outs):
        assert out.finish_reason == "stop", (method, name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert_all_blocks_free(llm.engine)
    assert not llm.engine.core.structured.matchers  # every grammar state released
    return [o.text for o in outs]


def _check_lossless(engines, methods, names, **kw) -> None:
    want = _check_json(engines(None), None, names, **kw)
    for method in methods:
        llm = engines(method)
        assert _check_json(llm, method, names, **kw) == want, method
        stats = llm.get_spec_stats()
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, method


def test_json_schemas_valid_and_lossless(engines):
    _check_lossless(engines, ["ngram", "suffix"], FAST_SCHEMAS)


@pytest.mark.slow
def test_all_json_schemas_valid_and_lossless(engines):
    assert len(SCHEMAS) >= 20
    _check_lossless(engines, list(SPECS), None)


@pytest.mark.slow
def test_seeded_sampling_identical_under_speculation(engines):
    """A seeded request's tokens do not depend on speculation (coupled verification), so the
    sampled JSON is the same text; it must also validate."""
    _check_lossless(engines, ["ngram", "suffix"], FAST_SCHEMAS, temperature=0.8, seed=7)


def _one(llm: LLM, prompt: str, so: StructuredOutputsParams, max_tokens: int = 24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
    return llm.generate([_chat(llm, prompt)], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("method", [None, "ngram"])
def test_regex_choice_grammar_json_object(engines, method):
    llm = engines(method)
    out = _one(llm, "Give a phone number like 555-1234.", StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text) and out.finish_reason == "stop"
    choices = ["Paris", "London", "Berlin"]
    out = _one(llm, "What is the capital of France?", StructuredOutputsParams(choice=choices))
    assert out.text in choices and out.finish_reason == "stop"
    lark = 'start: NUM " + " NUM " = " NUM\nNUM: /[0-9]{1,2}/'
    out = _one(llm, "Write a sum of two numbers.", StructuredOutputsParams(grammar=lark))
    assert re.fullmatch(r"[0-9]{1,2} \+ [0-9]{1,2} = [0-9]{1,2}", out.text), out.text
    gbnf = 'root ::= "yes" | "no"'
    out = _one(llm, "Is water wet?", StructuredOutputsParams(grammar=gbnf))
    assert out.text in ("yes", "no")
    out = _one(llm, "Describe a cat as JSON.", StructuredOutputsParams(json_object=True), max_tokens=64)
    # this prompt's greedy object runs past 64 tokens (it repeats keys): the cut text must still be
    # the prefix of some JSON object, checked by completing it and parsing with the stdlib
    assert out.finish_reason == "length" and _is_json_object_prefix(out.text), out.text


def _is_json_object_prefix(text: str) -> bool:
    """Whether some completion of ``text`` parses (``json.loads``) as a dict: close an open string,
    fill what a cut can leave wanting (a value, a key, the rest of a literal), close the brackets."""
    stack, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return False
    base = text + ('\\' if escaped else "") + ('"' if in_string else "")
    fills = ["", "0", "null", ": null", '"": null', "e", "ue", "se", "ll", "l", "rue", "alse", "ull", "1"]
    closers = "".join(reversed(stack))
    for fill in fills:
        try:
            if isinstance(json.loads(base + fill + closers), dict):
                return True
        except json.JSONDecodeError:
            pass
    return False


def test_mixed_batch_structured_and_free(engines):
    """A structured request does not change its neighbours' output, and vice versa."""
    llm = engines("ngram")
    free = SamplingParams(temperature=0, max_tokens=16)
    prompt = _chat(llm, "What is the capital of France?")
    alone = llm.generate([prompt], free, use_tqdm=False)[0].outputs[0].text
    # a real choice (not one forced answer), so the structured side's result can differ if disturbed
    so = SamplingParams(temperature=0, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(choice=["Paris", "London", "Berlin", "Rome"]))
    so_alone = llm.generate([prompt], so, use_tqdm=False)[0].outputs[0].text
    outs = llm.generate([prompt, prompt], [so, free], use_tqdm=False)
    assert so_alone in ("Paris", "London", "Berlin", "Rome")
    assert outs[0].outputs[0].text == so_alone and outs[1].outputs[0].text == alone


@pytest.mark.parametrize("method", [None, "ngram"])
def test_failed_steps_roll_back_the_grammar(engines, method, monkeypatch):
    """Steps that fail after the grammars consumed their tokens (here: in the output processor)
    are retried; the grammar state must be as before, so the output is the fault-free one."""
    names = ("person", "weather")
    want = _check_json(engines(method), method, names)
    llm = engines(method)
    outputs = llm.engine.core.outputs
    real = outputs.prepare
    calls = {"n": 0}

    def flaky(plan, *args):
        calls["n"] += 1
        if calls["n"] % 3 == 0 and any(e.new_token_ids for e in plan):
            raise RuntimeError("injected fault")
        return real(plan, *args)

    monkeypatch.setattr(outputs, "prepare", flaky)
    before = llm.engine.core.num_failed_attempts
    assert _check_json(llm, method, names) == want
    assert llm.engine.core.num_failed_attempts > before


def test_bad_structured_request_is_refused_before_anything_runs(engines):
    llm = engines(None)
    with pytest.raises(ValueError, match="structured_outputs.json"):
        SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nonsense"}))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "[a-"}), use_tqdm=False)
    assert_all_blocks_free(llm.engine)
