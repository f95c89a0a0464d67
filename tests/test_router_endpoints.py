"""What a router reads from a replica, on a real uvicorn server (``engine/serve/readiness.py``):
``/health`` 503 while the model loads, 200 once ready, 503 while draining (requests in flight
finish, new ones get 503); ``/v1/models`` with ``id``, ``owned_by``, ``root``,
``max_model_len``; ``/version``; ``/metrics`` with vLLM's names and a ``model_name`` label next to
the native ``tokenbudget_*`` ones, agreeing with ``get_stats()``.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tokenbudget.engine.entrypoints.async_llm import AsyncLLM  # noqa: E402

from engine_fixtures import ENGINE_OPTS, default_target  # noqa: E402
from serve_fixtures import MODEL, free_port, wait_idle  # noqa: E402

VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc")


def _wait(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@contextlib.contextmanager
def replica(load):
    """``make_replica_server`` in a thread on a free port; yields (url, server, loader thread)."""
    from tokenbudget.engine.serve.readiness import make_replica_server
    port = free_port()
    server, loader = make_replica_server(load, MODEL, port=port, grace_period=30, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait(lambda: server.started or not thread.is_alive())
        loader.start()
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(60)


def _samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_health_is_503_while_loading_then_200_and_the_probes_answer():
    release = threading.Event()
    holder: list = []

    def load():
        release.wait(60)
        holder.append(AsyncLLM(default_target(), **ENGINE_OPTS))
        return holder[0]

    with replica(load) as (url, server, _):
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        early = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert early.status_code == 503
        release.set()
        _wait(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200)
        (model,) = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert model["id"] == MODEL and model["owned_by"] == "tokenbudget" and model["root"]
        assert model["max_model_len"] == holder[0].engine.max_model_len
        version = httpx.get(f"{url}/version", timeout=10)
        assert version.status_code == 200 and version.json()["version"]

        r = httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": "The capital of France is",
                                                                   "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
        wait_idle(holder[0])
        samples = _samples(httpx.get(f"{url}/metrics", timeout=10).text)
        stats = holder[0].get_stats()
        for name in VLLM_GAUGES:
            (s,) = samples[name]
            assert s.labels == {"model_name": MODEL}, name
        assert samples["vllm:kv_cache_usage_perc"][0].value == stats.kv_usage
        assert 0.0 <= samples["vllm:gpu_cache_usage_perc"][0].value <= 1.0
        (info,) = samples["vllm:cache_config_info"]
        assert info.labels == {"block_size": str(holder[0].engine.config.block_size),
                               "num_gpu_blocks": str(stats.kv_blocks_total), "model_name": MODEL}
        (queries,) = samples["vllm:prefix_cache_queries_total"]
        (hits,) = samples["vllm:prefix_cache_hits_total"]
        assert queries.value == stats.prefix_cache_queries > 0 and hits.value == stats.prefix_cache_hits
        assert queries.labels == hits.labels == {"model_name": MODEL}
        assert samples["vllm:gpu_prefix_cache_queries_total"][0].value == queries.value  # the older names
        assert samples["vllm:gpu_prefix_cache_hits_total"][0].value == hits.value
        (gen,) = samples["vllm:generation_tokens_total"]
        assert gen.value == stats.num_generation_tokens_total >= 4
        assert samples["tokenbudget_kv_cache_usage_perc"][0].value == stats.kv_usage  # the native ones stay


def test_draining_health_is_503_new_work_503_in_flight_finishes():
    llm = AsyncLLM(default_target(), **ENGINE_OPTS)
    with replica(lambda: llm) as (url, server, thread):
        _wait(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200)
        lines: list = []
        body = {"prompt": "Hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}

        def client():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                lines.extend(r.iter_lines())
        t = threading.Thread(target=client)
        t.start()
        _wait(lambda: llm.get_stats().num_running > 0 or not t.is_alive())
        server.drain()  # what the first SIGTERM does
        health = httpx.get(f"{url}/health", timeout=10)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        metrics = httpx.get(f"{url}/metrics", timeout=10)
        t.join(60)
        thread.join(60)
        assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert metrics.status_code == 200  # routers still read the figures
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"  # the request in flight finished
        assert not thread.is_alive()  # and then the server stopped by itself
    wait_idle(llm)
