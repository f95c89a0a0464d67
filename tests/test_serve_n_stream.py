"""``n > 1`` with ``stream: true`` through the ``openai`` client, as vLLM streams it: every chunk
carries one choice with its ``index``, each choice's pieces join to exactly the text the same
seeded request gives without streaming (and ``LLM.generate``), ``stream_options.include_usage``
adds one last chunk counting every choice's tokens, and a client that goes away mid-stream aborts
every choice at once (the engine frees all of them)."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai", reason="needs the [test] extra (openai)")

from tokenbudget import LLM, AsyncLLM, SamplingParams  # noqa: E402

from engine_fixtures import ENGINE_OPTS, default_target  # noqa: E402
from serve_fixtures import KEY, MODEL, running_server, wait_idle  # noqa: E402

PROMPT = "Once upon a time,"
N, MAX_TOKENS = 3, 10


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
def offline() -> list[str]:
    params = SamplingParams(n=N, temperature=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [c.text for c in LLM(default_target(), **ENGINE_OPTS).generate(PROMPT, params, use_tqdm=False)[0].outputs]


def test_completions_stream_every_choice_with_its_index(client, llm, offline):
    texts, finishes, usage = [""] * N, [None] * N, None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, n=N, temperature=0.9, seed=5,
                                           max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert len(chunk.choices) == 1
        c = chunk.choices[0]
        texts[c.index] += c.text
        finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == offline and len(set(texts)) > 1
    assert finishes == ["length"] * N
    assert usage.completion_tokens == N * MAX_TOKENS and usage.total_tokens == usage.prompt_tokens + N * MAX_TOKENS
    wait_idle(llm)


def test_chat_streams_every_choice_as_its_non_streamed_twin(client, llm):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], n=N, temperature=0.9,
                  seed=7, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=1)
    whole = client.chat.completions.create(**kwargs)
    texts, roles, tokens, usage = [""] * N, [None] * N, [[] for _ in range(N)], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        roles[c.index] = c.delta.role or roles[c.index]
        texts[c.index] += c.delta.content or ""
        tokens[c.index] += [t.token for t in (c.logprobs.content if c.logprobs else None) or []]
    assert texts == [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
    assert roles == ["assistant"] * N
    assert tokens == [[t.token for t in c.logprobs.content] for c in sorted(whole.choices, key=lambda c: c.index)]
    assert usage.completion_tokens == whole.usage.completion_tokens
    wait_idle(llm)


def test_a_client_that_leaves_aborts_every_choice(url, llm):
    body = {"model": MODEL, "prompt": PROMPT, "n": N, "max_tokens": 400, "temperature": 0.9, "stream": True,
            "ignore_eos": True}
    seen, before = set(), wait_idle(llm).num_generation_tokens_total
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if seen == set(range(N)):
                break  # every choice is running: leave
    stats = wait_idle(llm)  # every choice ended, its blocks freed ...
    assert stats.num_generation_tokens_total - before < 400  # ... all of them long before their 400 tokens
