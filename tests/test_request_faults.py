"""A fault that belongs to one request ends that request and never the engine (issue 22).

Through the real server (uvicorn + httpx) on a tiny random Llama, and offline for a logits
processor (which no HTTP body can carry): grammars that fail mid-generation, grammars whose masks
cost more than the per-step budget, ``n`` children that all fail, one after another or together;
each time ``/health`` stays 200 and a neighbour's greedy text is unchanged. Also the two
correctness fixes found by tests ported from vLLM: stop strings wait for ``min_tokens``; the
prefix cache counts no query when caching is off.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tokenbudget import LLM, AsyncLLM, SamplingParams
from tokenbudget.engine.serve.limits import ServerLimits

from engine_fixtures import bounded  # noqa: E402
from serve_fixtures import KEY, running_server, wait_idle  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
OPTS = dict(num_threads=1, kv_cache_memory_bytes=4 << 20, max_model_len=256)
GREEDY = {"prompt": "The quick brown fox", "max_tokens": 30, "temperature": 0, "ignore_eos": True}


def wide_schema(num_properties: int) -> dict:
    """A short string ``k``, then an object ``a`` with that many optional integer properties:
    llguidance refuses the token that closes ``k`` (the next row holds ~4 items per property, past
    its 2000), a few tokens into the output, so the request fails after generation started. (A
    bare such object is refused at admission: its first token already fails.)"""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(num_properties)}}
    return {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}, "a": wide},
            "required": ["k", "a"]}


def chat_with_schema(schema: dict, **fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, **fields,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=1, hidden=32, scale=25.0)


@pytest.fixture(scope="module")
def llm(tiny_dir) -> AsyncLLM:
    # Prefix caching off (its query counter must stay 0); a 1 ms per-step mask budget.
    return AsyncLLM(tiny_dir, **OPTS, enable_prefix_caching=False, max_grammar_mask_ms=1.0)


@pytest.fixture(scope="module")
def url(llm):
    with running_server(llm, limits=ServerLimits(max_schema_bytes=1 << 20)) as base:
        yield base


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def reference(url) -> str:
    r = post(url, "/v1/completions", GREEDY)
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


def assert_healthy(url: str, reference: str) -> None:
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert post(url, "/v1/completions", GREEDY).json()["choices"][0]["text"] == reference


def test_grammar_failing_mid_generation_ends_its_request_not_the_engine(url, llm, reference):
    """Four in a row (it took four to kill the engine), then n=4 children together. Each is the
    request's own fault: a 400 naming response_format (a 500 once: routers retried it elsewhere)."""
    for body in [chat_with_schema(wide_schema(600))] * 4 + [chat_with_schema(wide_schema(600), n=4)]:
        r = post(url, "/v1/chat/completions", body)
        assert r.status_code == 400 and len(r.content) <= 4096
        assert r.json()["error"]["param"] == "response_format"
        assert "structured_outputs" in r.json()["error"]["message"]
        assert_healthy(url, reference)
    wait_idle(llm)


def test_grammar_failing_mid_stream_is_an_error_event_with_code_400(url, llm, reference):
    """A stream has sent its 200: the request's fault is the error event's code (was 500)."""
    body = {**chat_with_schema(wide_schema(600)), "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert error["code"] == 400 and error["param"] == "response_format" and error["type"] == "invalid_request_error"
    assert_healthy(url, reference)


def test_n_children_whose_grammar_has_no_first_token_are_a_400(url, llm, reference):
    r = post(url, "/v1/chat/completions", chat_with_schema({"$ref": "#"}, n=4))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "first token" in r.json()["error"]["message"]
    assert_healthy(url, reference)


def test_costly_masks_end_their_request_and_a_neighbour_is_unchanged(url, llm, reference):
    """Three requests whose masks cost far more than the budget (a 100000-character pattern)
    beside a greedy stream: they are refused (400) or end in error; the stream is as alone."""
    neighbour: list[str] = []
    thread = threading.Thread(target=lambda: neighbour.append(
        post(url, "/v1/completions", GREEDY).json()["choices"][0]["text"]))
    thread.start()
    costly = chat_with_schema({"type": "string", "pattern": "^a{100000}$"})
    for _ in range(3):
        r = post(url, "/v1/chat/completions", costly)
        assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["message"]
    thread.join(120)
    assert neighbour == [reference]
    cheap = post(url, "/v1/chat/completions", chat_with_schema({"type": "string", "pattern": "^ab+$"}))
    assert cheap.status_code == 200  # an ordinary grammar stays far under the same budget
    assert_healthy(url, reference)


def test_stop_string_is_not_checked_before_min_tokens(url, reference):
    """vLLM #21987: a stop string the model writes within its first min_tokens tokens does not
    end the request."""
    stop = next(ch for ch in reference[1:] if ch.isascii() and ch.isalnum())
    early = post(url, "/v1/completions", {**GREEDY, "stop": [stop]}).json()
    assert early["usage"]["completion_tokens"] < 15  # the model writes it early
    late = post(url, "/v1/completions", {**GREEDY, "stop": [stop], "min_tokens": 15}).json()
    assert late["usage"]["completion_tokens"] >= 15


def test_no_prefix_cache_query_is_counted_with_caching_off(url, llm):
    assert post(url, "/v1/completions", {**GREEDY, "max_tokens": 2}).status_code == 200
    wait_idle(llm)
    assert llm.get_stats().prefix_cache_queries == 0
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert "tokenbudget_prefix_cache_queries_total 0.0" in metrics


def test_logits_processor_fault_in_every_child_ends_them_not_the_engine(tiny_dir):
    """n=4 children whose processor raises: on their own in the step, they once looked like an
    engine-wide fault (every request of the step failing alone) and killed the engine."""
    offline = LLM(tiny_dir, **OPTS)

    def broken(output_ids, row):
        raise RuntimeError("processor bug")

    out = offline.generate(["hi"], SamplingParams(n=4, max_tokens=5, logits_processors=[broken]), use_tqdm=False)[0]
    assert [c.finish_reason for c in out.outputs] == ["error"] * 4
    assert "processor bug" in out.error
    again = offline.generate(["hi"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert again.outputs[0].finish_reason == "length"


def test_children_of_one_request_failing_alone_are_not_an_engine_fault(tiny_dir):
    """A fault no stage attributes (here injected in the runner) that only the n children of one
    request hit: each fails alone, which for two different requests would mean an engine-wide
    fault; for siblings it is one request failing, so the engine lives."""
    offline = LLM(tiny_dir, **OPTS)
    runner = offline.engine.core.runner
    real_execute = runner.execute

    def execute(sched):
        if any(sr.request_id.endswith("_doomed") for sr in sched.scheduled):
            raise RuntimeError("injected fault of the doomed request")
        return real_execute(sched)

    runner.execute = execute
    offline.engine.add_request("doomed", "hi", SamplingParams(n=3, max_tokens=4))
    outputs = []
    for _ in bounded(offline.engine.has_unfinished_requests):
        outputs.extend(offline.engine.step())
    assert offline.engine.is_healthy()
    assert [c.finish_reason for c in outputs[-1].outputs] == ["error"] * 3
    again = offline.generate(["hi"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert again.outputs[0].finish_reason == "length"


# ---------------------------------------------------------------- the step contract, on the fake model
def _fake_pair(poisoned: set[str], max_failed_steps: int = 2):
    """A harness whose runner raises a ``RequestFault`` for the ``poisoned`` requests whenever one
    is scheduled (as the grammar stage does), beside a fault-free twin."""
    from tokenbudget.scheduler.config import SchedulerConfig
    from tokenbudget.scheduler.request_fault import RequestFault
    from tokenbudget.testing.fingerprint import TransactionChecker
    from tokenbudget.testing.harness import Harness

    class PoisonedRunner:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def execute(self, sched):
            hit = {sr.request_id: "poisoned grammar" for sr in sched.scheduled if sr.request_id in poisoned}
            if hit:
                raise RequestFault(hit)
            return self.inner.execute(sched)

    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64, block_size=4,
                             num_blocks=64, enable_prefix_caching=True)
    h = Harness(config, seed=7, wrap_runner=PoisonedRunner)
    h.core.max_failed_steps = max_failed_steps
    checker = TransactionChecker(h.core)
    twin = Harness(config, seed=7)
    for i in range(5):
        for x in (h, twin):
            x.add(x.make_request(f"r{i}", [3 + i, 5, 7 + 2 * i, 11, 13, 2 + i], max_tokens=12, ignore_eos=True))
    return h, twin, checker


@pytest.mark.parametrize("poisoned", [{"r1", "r3"}, {f"r{i}" for i in range(5)}], ids=["some", "every"])
def test_request_faults_end_their_requests_and_never_count_towards_death(poisoned):
    """Even when every request of every step faults (an engine fault there would kill the engine,
    and ``max_failed_steps`` is 2), the engine lives: exactly the poisoned requests end in error,
    each failed attempt is rolled back, the others' tokens equal the fault-free twin's."""
    h, twin, checker = _fake_pair(poisoned)
    h.run_until_done(3, 0.6)
    twin.run_until_done(3, 0.6)
    assert h.core.is_healthy() and h.core.failed_steps_in_a_row == 0 and h.core.num_failed_attempts == 0
    assert {rid for rid, reason in h.finished.items() if reason == "error"} == poisoned
    for rid in set(twin.outputs) - poisoned:
        assert h.outputs[rid] == twin.outputs[rid] and h.finished[rid] == twin.finished[rid]
    assert checker.num_checked >= 1
    assert h.scheduler.kv.num_free_blocks == h.scheduler.kv.num_blocks
