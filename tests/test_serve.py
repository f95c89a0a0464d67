"""``tokenbudget serve`` end to end: the real uvicorn server, the real ``openai`` client and raw
HTTP (httpx) against the default model.

Greedy answers through the server equal ``LLM.generate``'s under 16 concurrent clients, with and
without speculation; usage adds up; logprobs carry token strings that spell the text; bad bodies
are 400s before any byte of a stream; a missing key is a 401; past the queue bound a 429.
"""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tokenbudget import LLM, AsyncLLM, SamplingParams

from engine_fixtures import ENGINE_OPTS, default_target  # noqa: E402
from serve_fixtures import KEY, MODEL, running_server, wait_idle  # noqa: E402

PROMPTS = [f"{head} {tail}" for head, tail in itertools.product(
    ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are"],
    ["", "Answer:", "In short,", "Note that"])]  # 16 prompts
MAX_TOKENS = 12
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def llm() -> AsyncLLM:
    return AsyncLLM(default_target(), **ENGINE_OPTS)


@pytest.fixture(scope="module")
def url(llm):
    with running_server(llm) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(llm) -> list[str]:
    """``LLM.generate``'s greedy text for each prompt (an LLM front end over the same model)."""
    offline = LLM(default_target(), **ENGINE_OPTS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in offline.generate(PROMPTS, params, use_tqdm=False)]


def _concurrent(client, extra_body=None) -> list[str]:
    def one(prompt):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=dict(ignore_eos=True, **(extra_body or {})))
        assert r.choices[0].finish_reason == "length"
        return r.choices[0].text
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, PROMPTS))


def test_greedy_equals_offline_under_16_clients(client, llm, reference):
    assert _concurrent(client) == reference
    assert _concurrent(client, {"speculative": {"num_speculative_tokens": 0}}) == reference
    wait_idle(llm)


def test_greedy_equals_offline_with_speculation(reference):
    spec_llm = AsyncLLM(default_target(), **ENGINE_OPTS,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    with running_server(spec_llm) as base:
        spec_client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        assert _concurrent(spec_client) == reference
        assert spec_llm.get_stats().spec_num_drafts > 0  # speculation really ran
        wait_idle(spec_llm)


def test_penalties_and_logit_bias_equal_offline(client, llm):
    """OpenAI's presence/frequency penalties, logit_bias (string token ids) and vLLM's
    repetition_penalty reach SamplingParams: greedy text equals LLM.generate with the same."""
    bias = {"28": -100.0, "30": 5.0}
    offline = LLM(default_target(), **ENGINE_OPTS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=0.5, repetition_penalty=1.3,
                            logit_bias={int(k): v for k, v in bias.items()})
    want = offline.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=0.5, logit_bias=bias,
                                  extra_body=dict(ignore_eos=True, repetition_penalty=1.3))
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=dict(ignore_eos=True))
    assert r.choices[0].text == want != plain.choices[0].text
    wait_idle(llm)


def test_completion_usage_and_logprobs(client, llm):
    prompt = PROMPTS[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    choice, usage = r.choices[0], r.usage
    assert usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert usage.completion_tokens == len(choice.logprobs.tokens) <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text  # token strings spell the text
    assert choice.logprobs.text_offset[0] == 0
    for token, lp, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert len(top) == 3 and lp <= 0
        assert max(top.values()) == pytest.approx(lp)  # greedy: the chosen token is the most likely
        assert top[token] == pytest.approx(lp)


def test_chat_stream_equals_non_stream_and_usage(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=2)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("stop", "length")
    assert "".join(t.token for t in full.choices[0].logprobs.content) == text
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: served from the prefix cache


def test_completion_stream_raw_sse(url):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "stream": True, "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "stream": True, "temperature": -1}, "temperature"),
    ({"prompt": "x", "stream": True, "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "stream": True, "top_p": 0}, "top_p"),
    ({"prompt": "x", "stream": True, "presence_penalty": 5.0}, "presence_penalty"),
    ({"prompt": "x", "stream": True, "logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"prompt": "x", "stream": True, "n": 0}, "n"),
    ({"prompt": "x", "stream": True, "speculative": {"num_speculative_tokens": -1}}, "num_speculative_tokens"),
    ({"stream": True}, "prompt"),
])
def test_bad_fields_are_400_before_the_stream(url, body, param):
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 400
        assert r.headers["content-type"].startswith("application/json")  # not an event stream
        error = json.loads(r.read())["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"


def test_openai_client_sees_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"unknown_knob": True})
    assert "unknown_knob" in str(info.value)


def test_api_key(url):
    body = {"prompt": "x", "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 401
    wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    models = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # open, for probes


def test_bench_serve_cli(url, tmp_path):
    from tokenbudget.cli.main import main
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in (
        {"prompt": PROMPTS[0]}, {"messages": [{"role": "user", "content": "Say hi"}]},
        {"question_id": 1, "category": "qa", "turns": ["What is 2+2?"]})) + "\n")
    out = tmp_path / "out.json"
    assert main(["bench", "serve", "--url", url, "--api-key", KEY, "--dataset", str(data), "--max-tokens", "4",
                 "--ignore-eos", "--concurrency", "2", "--output-json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["completed"] == 3 and summary["failed"] == 0
    assert summary["output_token_throughput"] > 0
    assert 0 < summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]


def test_prompt_longer_than_the_model_is_400(url):
    body = {"prompt": list(range(100, 700)), "max_tokens": 4, "stream": True}  # 600 ids > max_model_len 512
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt" and "max_model_len" in r.json()["error"]["message"]


def test_response_format_json_schema(client, llm):
    """OpenAI's response_format maps onto structured output: the answer parses and validates."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "Name the capital of France, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"city", "is_capital"} and isinstance(answer["is_capital"], bool)
    assert r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert "response_format" in str(info.value)
    wait_idle(llm)


def test_n_choices_equal_offline(client, llm):
    """``n`` samples of one prompt: n choices with their index, usage counting them all, the same
    seeded samples as ``LLM.generate`` (streamed: tests/test_serve_n_stream.py)."""
    offline = LLM(default_target(), **ENGINE_OPTS)
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [c.text for c in offline.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], n=3, temperature=0.8, seed=11,
                                  max_tokens=MAX_TOKENS, extra_body=dict(ignore_eos=True))
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == want and len(set(want)) > 1
    assert r.usage.completion_tokens == 3 * MAX_TOKENS
    wait_idle(llm)
