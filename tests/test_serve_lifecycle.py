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

from tokenbudget import AsyncLLM

from engine_fixtures import ENGINE_OPTS, default_loaded, default_target  # noqa: E402
from serve_fixtures import KEY, MODEL, free_port, running_server, wait_idle  # noqa: E402

prometheus_parser = pytest.importorskip("prometheus_client.parser")

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
    llm = AsyncLLM(default_target(), **dict(ENGINE_OPTS, max_num_seqs=1), max_queued_requests=1)
    with running_server(llm) as url:
        stop = threading.Event()
        first: list = []
        running = threading.Thread(target=_stream_first_chunk, args=(url, LONG, first, stop))
        running.start()
        _wait(lambda: len(first) > 2)  # streaming: it runs
        queued: list = []
        waiting = threading.Thread(target=_stream_first_chunk, args=(url, LONG, queued, stop))
        waiting.start()
        _wait(lambda: llm.get_stats().num_waiting == 1)  # max_num_seqs=1: the second one waits
        r = httpx.post(f"{url}/v1/completions", json=LONG, headers=AUTH, timeout=30)
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
        stop.set()  # both clients go away mid-stream
        running.join(30)
        waiting.join(30)
        stats = wait_idle(llm)
        assert stats.kv_blocks_used == 0
        assert not llm._streams


def test_non_streaming_disconnect_aborts(llm_and_url):
    llm, url = llm_and_url
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=LONG, headers=AUTH, timeout=httpx.Timeout(30, read=1.0))
    stats = wait_idle(llm, timeout=10)  # far sooner than 400 tokens would take
    assert stats.num_generation_tokens_total < 400


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
    assert all(name.startswith("tokenbudget_") for name in families)
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


def test_sigterm_drains_and_exits_zero(tmp_path):
    """A real ``tokenbudget serve`` process: a request in flight at SIGTERM still completes, new
    connections are refused, the process exits 0."""
    default_loaded()  # skips when the default model cannot be had
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "tokenbudget.cli.main", "serve", "--port", str(port),
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
    with running_server(llm, grace_period=0.5, stopper=servers) as url:
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
        _wait(lambda: len(lines) > 2)
        servers[0].should_exit = True
        t.join(60)
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert "[DONE]" not in events
    assert all(json.loads(e).get("choices", [{}])[0].get("finish_reason") in (None, "abort") for e in events)
    stats = wait_idle(llm)
    assert stats.num_generation_tokens_total < 400
