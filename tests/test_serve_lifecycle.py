"""``tokenbudget serve`` under load and failure: 429 past the queue bound, client disconnects
abort their requests (the engine is back to idle, every KV block free), ``/metrics`` parses with
``prometheus_client``'s parser, ``/health`` turns 503 once the engine dies, and SIGTERM drains
and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client import parser as prometheus_parser

from tokenbudget import AsyncLLM

from engine_fixtures import ENGINE_OPTS, StepGate, default_loaded, default_target  # noqa: E402
from serve_fixtures import KEY, MODEL, free_port, running_server, wait_idle  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 400, "temperature": 0,
        "ignore_eos": True}


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _stream_first_chunk(url: str, body: dict, holder: list, stop: threading.Event) -> None:
    """Stream ``body`` until ``stop`` is set (then disconnect); the events read go to ``holder``."""
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), headers=AUTH, timeout=60) as r:
        holder.append(r.status_code)
        for line in r.iter_lines():
            holder.append(line)
            if stop.is_set():
                return


def test_429_past_max_queued_requests_then_disconnects_free_everything():
    """The engine steps only when the gate grants it, so the first request is still running (a
    few of its 400 tokens made) when the third arrives, however fast the machine."""
    llm = AsyncLLM(default_target(), **dict(ENGINE_OPTS, max_num_seqs=1), max_queued_requests=1)
    with running_server(llm) as url, StepGate(llm) as gate:
        stop = threading.Event()
        first: list = []
        running = threading.Thread(target=_stream_first_chunk, args=(url, LONG, first, stop))
        running.start()
        gate.run_until(lambda: len(first) > 2)  # streaming: it runs
        queued: list = []
        waiting = threading.Thread(target=_stream_first_chunk, args=(url, LONG, queued, stop))
        waiting.start()
        gate.run_until(lambda: llm.get_stats().num_waiting == 1)  # max_num_seqs=1: the second one waits
        assert llm.get_stats().num_running == 1
        r = httpx.post(f"{url}/v1/completions", json=LONG, headers=AUTH, timeout=30)
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
        stop.set()  # both clients go away mid-stream (each at its next event)
        gate.open()
        running.join(30)
        waiting.join(30)
        stats = wait_idle(llm)
        assert stats.kv_blocks_used == 0
        assert not llm._streams


def test_non_streaming_disconnect_aborts(llm_and_url):
    """The gate holds the engine's first step, so the 1 s read timeout always fires with the request
    unfinished; the server must then abort it, before the gate lets the engine go on."""
    llm, url = llm_and_url
    before = llm.get_stats().num_generation_tokens_total
    with StepGate(llm) as gate:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=LONG, headers=AUTH, timeout=httpx.Timeout(30, read=1.0))
        _wait(lambda: gate.parked and not llm._streams)  # the disconnect aborted its stream
        gate.open()
        stats = wait_idle(llm)
    assert stats.num_generation_tokens_total - before <= 1  # the held step's token at most, never 400


@pytest.fixture(scope="module")
def llm_and_url():
    llm = AsyncLLM(default_target(), **ENGINE_OPTS)
    with running_server(llm) as url:
        yield llm, url


def test_metrics_parse(llm_and_url):
    llm, url = llm_and_url
    for _ in range(2):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                                      "ignore_eos": True}, headers=AUTH, timeout=60)
        assert r.status_code == 200
    text = httpx.get(f"{url}/metrics", timeout=30).text
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}
    assert all(name.startswith(("tokenbudget_", "vllm:")) for name in families)  # vllm: for routers
    for name in ("tokenbudget_time_to_first_token_seconds", "tokenbudget_time_per_output_token_seconds",
                 "tokenbudget_e2e_request_latency_seconds", "tokenbudget_request_queue_time_seconds"):
        assert families[name].type == "histogram"
        count = next(s.value for s in families[name].samples if s.name == name + "_count")
        assert count >= 2
    values = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    stats = llm.get_stats()
    assert values["tokenbudget_generation_tokens_total"] == stats.num_generation_tokens_total >= 6
    assert values["tokenbudget_num_requests_running"] == 0
    assert values["tokenbudget_kv_cache_blocks_total"] == stats.kv_blocks_total
    success = {s.labels["finished_reason"]: s.value for s in families["tokenbudget_request_success"].samples
               if s.name == "tokenbudget_request_success_total"}
    assert success["length"] >= 2


def test_health_turns_503_after_an_engine_wide_failure():
    llm = AsyncLLM(default_target(), **ENGINE_OPTS)
    with running_server(llm) as url:
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        llm.engine.core.max_failed_steps = 1  # one step in which nothing runs: dead

        def broken(sched):
            raise RuntimeError("device lost")
        llm.engine.core.runner.execute = broken
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, headers=AUTH, timeout=60)
        assert r.status_code in (500, 503) and "error" in r.json()
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503
        again = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, headers=AUTH, timeout=60)
        assert again.status_code == 503
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert "tokenbudget_engine_healthy 0.0" in text


# ``tokenbudget serve`` whose engine parks after its first two steps until the file argv[1] exists:
# the test, not the machine's speed, decides that a request is still in flight at SIGTERM.
GATED_SERVE = """
import os, sys, time
from tokenbudget.cli.main import main
from tokenbudget.engine.entrypoints.llm_engine import LLMEngine
real, gate, steps = LLMEngine.step, sys.argv[1], [0]
def step(self):
    deadline = time.monotonic() + 120
    while steps[0] >= 2 and not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise RuntimeError("the test never opened the gate")
        time.sleep(0.01)
    steps[0] += 1
    return real(self)
LLMEngine.step = step
sys.exit(main(sys.argv[2:]))
"""


def _draining(url: str) -> bool:
    """``/health`` answers 503 (the server still listens: a router sees it drain)."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 503
    except httpx.TransportError:
        return False


def test_sigterm_drains_and_exits_zero(tmp_path):
    """A real ``tokenbudget serve`` process: a request in flight at SIGTERM (held there by a gate)
    still completes once let go; meanwhile ``/health`` and new requests answer 503 (a router
    stops sending and retries elsewhere: engine/serve/readiness.py); the process exits 0."""
    default_loaded()  # skips only when the default model cannot be had (engine_fixtures)
    port = free_port()
    gate = tmp_path / "gate"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", GATED_SERVE, str(gate), "serve", "--port", str(port),
                             "--no-spec", "--num-threads", "1", "--max-model-len", "256", "--grace-period", "30",
                             "--kv-cache-memory-bytes", str(32 << 20)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.2)
        result: list = []
        body = {"prompt": "Hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}

        def client():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                result.extend(r.iter_lines())
        t = threading.Thread(target=client)
        t.start()
        _wait(lambda: len(result) > 0 or not t.is_alive())
        proc.send_signal(signal.SIGTERM)
        _wait(lambda: _draining(url))
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.headers["retry-after"] == "1"  # new work goes elsewhere
        assert t.is_alive() and "data: [DONE]" not in result  # held by the gate: still in flight
        gate.touch()
        t.join(60)
        assert proc.wait(60) == 0
        events = [line[len("data: "):] for line in result if line.startswith("data: ")]
        assert events[-1] == "[DONE]"  # drained: the request in flight finished
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_shutdown_past_the_grace_period_is_not_reported_as_success():
    """Requests still running when the drain ends are aborted: their stream ends without a
    finish_reason and without ``[DONE]``, and the engine is left idle."""
    llm = AsyncLLM(default_target(), **ENGINE_OPTS)
    servers: list = []
    lines: list = []
    with running_server(llm, grace_period=0.5, stopper=servers) as url, StepGate(llm) as gate:
        def client():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=dict(LONG, stream=True), headers=AUTH,
                                  timeout=60) as r:
                    for line in r.iter_lines():
                        lines.append(line)
            except httpx.HTTPError:
                pass  # the server closed the connection: expected
        t = threading.Thread(target=client)
        t.start()
        gate.run_until(lambda: len(lines) > 2)  # running, and held from here on: it cannot finish
        servers[0].should_exit = True
        t.join(60)
        assert not t.is_alive()
        gate.open()
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert "[DONE]" not in events
    assert all(json.loads(e).get("choices", [{}])[0].get("finish_reason") in (None, "abort") for e in events)
    stats = wait_idle(llm)
    assert stats.num_generation_tokens_total < 400
