"""The Ray Serve deployment (``tokenbudget.integrations.ray.serve``) on a real local Ray cluster:
two replicas behind Ray's HTTP proxy on 127.0.0.1 answer the OpenAI routes and the router
probes; ``max_ongoing_requests`` is raised from Ray's default of 5; scaling down to one replica
drains: streams in flight on the removed replica still end with ``[DONE]``.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

ray = pytest.importorskip("ray", reason="needs the [ray] extra: ray[data,serve]")
serve = pytest.importorskip("ray.serve", reason="needs the [ray] extra: ray[data,serve]")
httpx = pytest.importorskip("httpx")

from engine_fixtures import ENGINE_OPTS, default_loaded  # noqa: E402
from serve_fixtures import free_port  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def serve_url():
    default_loaded()  # skips when the default model cannot be had
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_two_replicas_serve_and_scale_down_drains(serve_url):
    from tokenbudget.integrations.ray.serve import MAX_ONGOING_REQUESTS, TokenbudgetDeployment, app_builder

    assert TokenbudgetDeployment._deployment_config.max_ongoing_requests == MAX_ONGOING_REQUESTS > 5

    def deploy(n: int):  # what `serve run tokenbudget.integrations.ray.serve:app_builder k=v ...` does
        args = {"num_replicas": str(n), **{k: json.dumps(v) for k, v in ENGINE_OPTS.items()}}
        serve.run(app_builder(args), name="tokenbudget", route_prefix="/")

    deploy(2)
    r = httpx.post(f"{serve_url}/v1/completions", timeout=120,
                   json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert httpx.get(f"{serve_url}/health", timeout=30).status_code == 200
    assert "vllm:kv_cache_usage_perc" in httpx.get(f"{serve_url}/metrics", timeout=30).text

    n = 4  # Ray routes them over both replicas (power of two choices by queue length)
    streams: list[list[str]] = [[] for _ in range(n)]
    started = [threading.Event() for _ in range(n)]
    body = {"prompt": "Tell me a story", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}

    def client(i: int) -> None:
        with httpx.stream("POST", f"{serve_url}/v1/completions", json=body, timeout=180) as resp:
            for line in resp.iter_lines():
                streams[i].append(line)
                started[i].set()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), "a stream never started"
    deploy(1)  # scale down while both streams run: the removed replica drains first
    for t in threads:
        t.join(180)
    for lines in streams:
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
