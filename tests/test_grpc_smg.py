"""Two ``tokenbudget serve --grpc`` workers behind a real ``smg launch`` in gRPC mode (loopback).

The gateway fetches the tokenizer from a worker (``GetTokenizer``), tokenizes and applies the
chat template itself, sends token ids (``Generate``) and indexes each worker's KV-cache events
(``SubscribeKvEvents``). Checked: a completion and a chat through the gateway equal the offline
engine's greedy outputs; ``cache_aware`` sends every repeat of a long shared prefix to the worker
that holds it (each repeat is served from that worker's prefix cache, both workers serve some
prefixes, and the gateway's metrics count every repeat as routed by a KV-event index hit: with
the event stream muted the gateway still guesses right here, but from its own tree, and this
fails); a killed worker is routed around.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc", reason="needs the [grpc] extra (pip install 'tokenbudget[grpc]')")
pytest.importorskip("smg_grpc_proto", reason="needs the [grpc] extra (pip install 'tokenbudget[grpc]')")
from smg_grpc_proto import vllm_engine_pb2 as pb  # noqa: E402
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc  # noqa: E402

from tokenbudget import LLM, SamplingParams  # noqa: E402

from engine_fixtures import default_target  # noqa: E402
from serve_fixtures import free_port, stop_process, wait_until  # noqa: E402

pytestmark = pytest.mark.router
SMG = shutil.which("smg", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
if SMG is None:
    pytest.skip("needs the [router] extra: the smg command (pip install 'tokenbudget[router]')",
                allow_module_level=True)

MODEL = "SmolLM2-135M-Instruct"
OPTS = ["--no-spec", "--num-threads", "1", "--max-model-len", "512", "--grace-period", "2",
        "--kv-cache-memory-bytes", str(32 << 20)]
PREFIXES = [(f"You are a careful assistant for shipping company number {k}. Answer in one short sentence, name the "
             "warehouse, and never invent tracking numbers. The warehouses are Rotterdam, Hamburg, Antwerp, "
             "Felixstowe, Le Havre, Algeciras and Valencia; each handles containers for one region. ") * 2
            for k in range(4)]


def _healthy(stub) -> bool:
    try:
        return stub.HealthCheck(pb.HealthCheckRequest(), timeout=2).healthy
    except grpc.RpcError:
        return False


@pytest.fixture(scope="module")
def fleet():
    workers = []
    try:
        for _ in range(2):
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "tokenbudget.cli.main", "serve", "--grpc", str(port), *OPTS],
                                    env=dict(os.environ, OMP_NUM_THREADS="1"),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            workers.append((port, proc, pb_grpc.VllmEngineStub(grpc.insecure_channel(f"127.0.0.1:{port}"))))
        for port, proc, stub in workers:
            wait_until(lambda: proc.poll() is not None or _healthy(stub), 180, f"worker {port}")
            assert proc.poll() is None, f"worker {port} exited"
        gw_port, metrics_port = free_port(), free_port()
        url = f"http://127.0.0.1:{gw_port}"
        gateway = subprocess.Popen([SMG, "launch", "--host", "127.0.0.1", "--port", str(gw_port),
                                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                                    "--worker-urls", *[f"grpc://127.0.0.1:{p}" for p, _, _ in workers],
                                    "--policy", "cache_aware", "--block-size", "16", "--log-level", "warn"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        workers.append((gw_port, gateway, None))

        def ready() -> bool:
            try:
                r = httpx.get(url + "/workers", timeout=2)
                return r.status_code == 200 and sum(w.get("is_healthy", False) for w in r.json()["workers"]) == 2
            except httpx.TransportError:
                return False
        wait_until(lambda: gateway.poll() is not None or ready(), 60, "the gateway to register both workers")
        assert gateway.poll() is None, "smg exited"

        def serves() -> bool:  # the tokenizer (GetTokenizer) registers a moment after the workers
            return httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi",
                                                                         "max_tokens": 1}).status_code == 200
        wait_until(serves, 60, "the gateway to serve (its tokenizer fetched from a worker)")
        yield url, workers[:2], f"http://127.0.0.1:{metrics_port}"
    finally:
        for _, proc, _ in workers:
            stop_process(proc)


def _complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_and_chat_through_the_gateway_equal_offline(fleet):
    url, _, _ = fleet
    offline = LLM(default_target(), num_threads=1, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        assert _complete(url, prompt)["choices"][0]["text"] == offline.generate(prompt, greedy)[0].outputs[0].text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == offline.chat(messages, greedy)[0].outputs[0].text


def _event_hits(metrics_url: str) -> float:
    """Routing decisions the gateway took from a worker's KV-event index (a prefix it knows the
    worker holds from that worker's events), not from its own guess of what it sent where."""
    text = httpx.get(metrics_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('smg_cache_aware_policy_branch_total{branch="event_hit"}'))


def test_cache_aware_sends_a_repeated_prefix_to_its_holder(fleet):
    url, workers, metrics_url = fleet
    hits_before = _event_hits(metrics_url)
    for rep in range(3):
        for k, prefix in enumerate(PREFIXES):
            usage = _complete(url, prefix + f"Question {rep}: which warehouse?", max_tokens=2)["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if rep:  # a repeat: served by the worker that holds the prefix, from its cache
                assert cached >= 16 * 6, f"prefix {k}, repeat {rep}: {cached} cached tokens (routed elsewhere?)"
    rates = [stub.GetLoads(pb.GetLoadsRequest()).loads[0].cache_hit_rate for _, _, stub in workers]
    assert all(rate > 0 for rate in rates), f"one worker took every prefix: hit rates {rates}"
    assert _event_hits(metrics_url) - hits_before >= 2 * len(PREFIXES), "repeats not routed by the KV events"


def test_a_killed_worker_is_routed_around(fleet):
    url, workers, _ = fleet
    stop_process(workers[1][1])
    for k in range(4):
        out = _complete(url, f"Tell me about the number {k}.", max_tokens=4)  # 200, by the survivor
        assert out["usage"]["completion_tokens"] >= 1 and out["choices"][0]["finish_reason"] in ("stop", "length")
