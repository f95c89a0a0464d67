"""Hostile requests against the real server (uvicorn + httpx) on a tiny random Llama: each case
is refused with the right status naming the field or the limit, its error body is small, and the
server is left healthy: ``/health`` 200 right after, a plain greedy completion unchanged.

To add a case, add one line to ``CASES``: an id, the route, the body (a dict, or bytes sent as
they are), the expected status and ``error.param``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tokenbudget import AsyncLLM

from serve_fixtures import KEY, running_server, wait_idle  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def nested(depth: int, leaf="x") -> object:
    """``[[[...leaf...]]]``, ``depth`` lists deep, built without recursion."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def deep_schema(depth: int, kind: str) -> bytes:
    """A chat body whose JSON schema nests ``depth`` objects or arrays, spelled out as JSON text
    (Python's json module refuses to write it)."""
    head = '{"type": "object", "properties": {"a": ' if kind == "object" else '{"type": "array", "items": '
    tail = "}}" if kind == "object" else "}"
    schema = head * depth + '{"type": "integer"}' + tail * depth
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + schema + "}}}").encode()


def json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def raw_json(text: str) -> bytes:
    """A body spelled out as JSON text (for nesting Python's json module would refuse to write)."""
    return text.encode()


CASES = [
    # id, route, body, status, error.param
    ("n4-schema-ref-self", CHAT, chat(n=4, response_format=json_schema({"$ref": "#"})), 400, "response_format"),
    ("schema-ref-self", CHAT, chat(response_format=json_schema({"$ref": "#"})), 400, "response_format"),
    ("content-part-100k-deep", CHAT, raw_json('{"messages": [{"role": "user", "content": [{"type": "text", "text": '
                                             + "[" * 100_000 + "]" * 100_000 + "}]}]}"), 400, "messages"),
    ("response-format-100k-deep", CHAT, raw_json('{"messages": [{"role": "user", "content": "hi"}], '
                                                '"response_format": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000
                                                + "}"), 400, "response_format"),
    ("content-part-44-deep-is-served", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "x": nested(40, 1)}]}]), 200, None),  # > 32: refused once
    ("content-part-65-deep", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "x": nested(61, 1)}]}]), 400, "messages"),
    ("schema-1000-objects-deep", CHAT, deep_schema(1000, "object"), 400, "response_format"),
    ("schema-3000-arrays-deep", CHAT, deep_schema(3000, "array"), 400, "response_format"),
    ("schema-12-objects-deep-is-served", CHAT, deep_schema(12, "object"), 200, None),
    ("schema-5MB-description", CHAT, chat(response_format=json_schema(
        {"type": "object", "description": "d" * (5 << 20)})), 413, None),
    ("schema-200KB-description", CHAT, chat(response_format=json_schema(
        {"type": "string", "description": "d" * 200_000})), 400, "response_format"),
    ("schema-5000-optional-properties", CHAT, chat(response_format=json_schema(
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}})), 400,
     "response_format"),
    ("schema-600-optional-properties-too-complex", CHAT, chat(response_format=json_schema(
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}})), 400, "response_format"),
    ("model-name-10MB", COMPLETIONS, {"model": "m" * (10 << 20), "prompt": "hi"}, 413, None),
    ("model-name-1MB", COMPLETIONS, {"model": "m" * (1 << 20), "prompt": "hi"}, 404, "model"),
    ("prompt-30MB", COMPLETIONS, {"prompt": "a" * (30 << 20), "max_tokens": 1}, 413, None),
    ("prompt-3MB-past-the-context-in-bytes", COMPLETIONS, {"prompt": "a" * (3 << 20), "max_tokens": 1}, 400, "prompt"),
    ("chat-3MB-past-the-context-in-bytes", CHAT, {"messages": [{"role": "user", "content": "é" * (1 << 20)}]}, 400,
     "messages"),
    ("prompt-token-ids-past-the-context", COMPLETIONS, {"prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 1}, 400,
     "prompt"),
    ("max-tokens-2**64", COMPLETIONS, {"prompt": "hi", "max_tokens": 2**64}, 400, "max_tokens"),
    ("max-tokens-2**63-1", COMPLETIONS, {"prompt": "hi", "max_tokens": 2**63 - 1}, 400, "max_tokens"),
    ("max-tokens-past-the-context", COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("max-completion-tokens-past-the-context", CHAT, chat(max_completion_tokens=10**9), 400, "max_completion_tokens"),
    ("n-1000", COMPLETIONS, {"prompt": "hi", "n": 1000}, 400, "n"),
    ("stop-1000-strings", COMPLETIONS, {"prompt": "hi", "stop": [f"s{i}" for i in range(1000)]}, 400, "stop"),
    ("stop-string-100KB", COMPLETIONS, {"prompt": "hi", "stop": "s" * 100_000}, 400, "stop"),
    ("stop-token-ids-950k", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [7] * 950_000}, 400, "stop_token_ids"),
    ("stop-token-ids-257", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [7] * 257}, 400, "stop_token_ids"),
    ("chat-role-3MB", CHAT, {"messages": [{"role": "r" * (3 << 20), "content": "hi"}]}, 400, "messages"),
    ("logit-bias-5000-entries", COMPLETIONS, {"prompt": "hi", "logit_bias": {str(i % 259): 1.0 for i in range(5000)}
                                              | {f"0{i}": 1.0 for i in range(5000)}}, 400, "logit_bias"),
    ("not-json", COMPLETIONS, b"{\"prompt\": ", 400, None),
    ("not-an-object", COMPLETIONS, b"[" * 50_000, 400, None),
    ("unknown-field-1MB-name", COMPLETIONS, raw_json('{"prompt": "hi", "' + "f" * (1 << 20) + '": 1}'), 400, None),
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> AsyncLLM:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=1, hidden=32, scale=25.0)
    return AsyncLLM(path, num_threads=1, kv_cache_memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def url(llm):
    with running_server(llm) as base:
        yield base


def greedy(url: str) -> str:
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}{COMPLETIONS}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text[:500]
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def reference(url) -> str:
    return greedy(url)


@pytest.mark.parametrize(("route", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_request_is_refused_and_the_server_stays_healthy(url, llm, reference, route, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    r = httpx.post(f"{url}{route}", content=content, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=120)
    assert r.status_code == status, r.text[:500]
    assert len(r.content) <= 4096
    if status != 200:
        assert r.json()["error"]["param"] == param, r.text[:500]
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert greedy(url) == reference
    wait_idle(llm)


def test_chunked_body_past_the_limit_is_413_without_reading_it_all(url):
    """No Content-Length (chunked): counted as it arrives, refused once past the limit."""
    def chunks():
        for _ in range(64):
            yield b" " * (1 << 20)
    r = httpx.post(f"{url}{COMPLETIONS}", content=chunks(), headers={**AUTH, "Content-Type": "application/json"},
                   timeout=120)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
