"""Replicas behind the router people already run: two real ``tokenbudget serve`` processes on
127.0.0.1 behind SMG (``smg launch``, the [router] extra), with no adapter in between.

* ``round_robin``: both replicas' request counters rise.
* ``cache_aware``: prompts sharing a long prefix land on one replica (and hit its prefix cache).
* ``least_load``: requests are served, and SMG's load monitor holds a load entry for every replica;
  SMG reads it from ``vllm:kv_cache_usage_perc`` and friends and holds none for a replica whose
  ``/metrics`` lacks the KV gauge, so this fails if the gauge goes missing.
* a replica killed mid-run: every request through the router ends (served by the survivor, or a
  clean error status), nothing hangs, and the router goes on serving.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine_fixtures import default_loaded  # noqa: E402
from serve_fixtures import free_port, stop_process, wait_until  # noqa: E402

pytestmark = pytest.mark.router
SMG = shutil.which("smg", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
if SMG is None:
    pytest.skip("needs the [router] extra: the smg command (pip install 'tokenbudget[router]')",
                allow_module_level=True)

MODEL = "SmolLM2-135M-Instruct"
PREFIX = ("You are a careful assistant for a shipping company. Answer in one short sentence, name the "
          "warehouse, and never invent tracking numbers. The warehouses are Rotterdam, Hamburg, Antwerp, "
          "Felixstowe, Le Havre, Algeciras and Valencia; each handles containers for one region. Question: ")


def _ok(url: str, path: str) -> bool:
    try:
        return httpx.get(url + path, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _start_replica() -> tuple[str, subprocess.Popen]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "tokenbudget.cli.main", "serve", "--port", str(port),
                             "--no-spec", "--num-threads", "1", "--max-model-len", "512", "--grace-period", "5",
                             "--kv-cache-memory-bytes", str(32 << 20)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", proc


def _ready(replicas) -> None:
    for url, proc in replicas:
        wait_until(lambda: proc.poll() is not None or _ok(url, "/health"), 180, f"{url}/health")
        assert proc.poll() is None, f"replica {url} exited"


class Router:
    """``smg launch`` over ``workers`` with ``policy`` on loopback ports; ``url``."""

    def __init__(self, workers: list[str], policy: str, *extra: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
                                      "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                      "--worker-urls", *workers, "--policy", policy, "--log-level", "warn",
                                      "--load-monitor-interval", "1", *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: self.proc.poll() is not None or self._healthy_workers() == len(workers), 60,
                  f"SMG to register {workers}")
            assert self.proc.poll() is None, "smg exited"
        except BaseException:
            stop_process(self.proc)
            raise

    def _healthy_workers(self) -> int:
        try:
            r = httpx.get(self.url + "/workers", timeout=2)
        except httpx.TransportError:
            return -1
        return sum(w.get("is_healthy", False) for w in r.json().get("workers", [])) if r.status_code == 200 else -1

    def complete(self, prompt: str, max_tokens: int = 4, timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", timeout=timeout,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _finished(url: str) -> float:
    return _metric(url, "tokenbudget_request_success_total")


@pytest.fixture(scope="module")
def replicas():
    default_loaded()  # skips when the default model cannot be had
    started = [_start_replica() for _ in range(2)]
    try:
        _ready(started)
        yield [url for url, _ in started]
    finally:
        for _, proc in started:
            stop_process(proc)


def test_round_robin_spreads_over_both_replicas(replicas):
    before = [_finished(u) for u in replicas]
    with Router(replicas, "round_robin") as router:
        for i in range(6):
            r = router.complete(f"Count to {i}:")
            assert r.status_code == 200, r.text
    gained = [_finished(u) - b for u, b in zip(replicas, before)]
    assert sum(gained) == 6 and min(gained) >= 2, gained


def test_cache_aware_keeps_a_shared_prefix_on_one_replica(replicas):
    before = [_finished(u) for u in replicas]
    hits_before = [_metric(u, "vllm:prefix_cache_hits_total") for u in replicas]
    with Router(replicas, "cache_aware") as router:
        for city in ("Lyon", "Oslo", "Porto", "Riga", "Turin", "Gdansk"):
            r = router.complete(PREFIX + f"which warehouse serves {city}?")
            assert r.status_code == 200, r.text
    gained = [_finished(u) - b for u, b in zip(replicas, before)]
    assert sorted(gained) == [0, 6], gained
    home = gained.index(6)
    assert _metric(replicas[home], "vllm:prefix_cache_hits_total") - hits_before[home] > 5 * 16  # the prefix reused


def test_least_load_serves_and_reads_every_replicas_kv_gauge(replicas):
    for url in replicas:
        assert _metric(url, "vllm:kv_cache_usage_perc") >= 0.0  # the gauge SMG reads is there
    with Router(replicas, "least_load") as router:
        for i in range(4):
            r = router.complete(f"Name a color, {i}:")
            assert r.status_code == 200, r.text

        def loaded_workers() -> set:
            loads = httpx.get(router.url + "/get_loads", timeout=5).json().get("loads", [])
            return {entry["worker"] for entry in loads}
        wait_until(lambda: loaded_workers() == set(replicas), 30, "SMG's load monitor to read both replicas")


def test_a_replica_killed_mid_run_fails_over_or_fails_cleanly(replicas):
    victim_url, victim = _start_replica()
    try:
        _ready([(victim_url, victim)])
        with Router([replicas[0], victim_url], "round_robin") as router:
            results: list = []

            def client(i: int) -> None:
                try:
                    results.append(router.complete(f"Tell a long story about ship {i}:", max_tokens=48,
                                                   timeout=150).status_code)
                except httpx.HTTPError as exc:  # the router closed the connection: a clean failure too
                    results.append(type(exc).__name__)
            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(6)]
            for t in threads:
                t.start()
            wait_until(lambda: _metric(victim_url, "vllm:num_requests_running") > 0, 60, "the victim to be busy")
            victim.send_signal(signal.SIGKILL)
            for t in threads:
                t.join(180)
            assert not any(t.is_alive() for t in threads), "a request through the router hangs"
            assert len(results) == 6
            assert all(r == 200 or (isinstance(r, int) and r >= 500) or isinstance(r, str) for r in results), results
            after = [router.complete(f"After the crash, {i}:", timeout=60).status_code for i in range(4)]
            assert after.count(200) >= 2, after  # the survivor keeps serving through the router
    finally:
        stop_process(victim)
