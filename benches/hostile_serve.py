"""What hostile requests cost the others: ``tokenbudget serve`` (default model) in a subprocess,
loaded from this process with httpx.

    PYTHONPATH=. python benches/hostile_serve.py [--num-threads 1] [--max-tokens 64]

1. ``/health`` latency (polled every 20 ms from this process, so it includes this process's own
   sending of the body) while a 30 MB completion body is sent: with the
   default limits (413 from ``Content-Length``) and with ``--max-request-bytes`` raised to 64 MiB
   (the prompt's byte length refuses it before tokenizing: 400); the server's RSS before, after
   and at its peak (``VmHWM``).
2. A neighbour's greedy stream (``--max-tokens`` tokens, ``ignore_eos``) alone, then beside three
   chat requests whose JSON schema is the pattern ``^a{100000}$`` (mask ~20 ms per step on the
   49k vocabulary): its wall time side by side, and what the three got. Timings are noisy on a
   shared machine: compare the ratio.
3. ``--schema-cache-only``: this process's RSS around 20 schemas with a 5 MB description.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(extra: list[str], num_threads: int):
    port = free_port()
    cmd = [sys.executable, "-m", "tokenbudget", "serve", "--port", str(port), "--num-threads", str(num_threads),
           "--max-model-len", "2048", "--no-spec", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(60)


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def health_while(url: str, work) -> tuple[list[float], object]:
    """/health latencies (s) polled while ``work()`` runs in a thread; and its result."""
    result, latencies = [], []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    while thread.is_alive():
        t = time.perf_counter()
        status = httpx.get(f"{url}/health", timeout=120).status_code
        latencies.append(time.perf_counter() - t)
        assert status == 200
        time.sleep(0.02)
    thread.join()
    return latencies, result[0]


BIG_BODY = json.dumps({"prompt": "a" * (30 << 20), "max_tokens": 1}).encode()  # built once, before timing


def big_prompt(url: str) -> str:
    body = BIG_BODY
    r = httpx.post(f"{url}{COMPLETIONS}", content=body, headers={"Content-Type": "application/json"}, timeout=300)
    return f"{r.status_code} ({len(r.content)} bytes: {r.json()['error']['message'][:90]})"


def greedy(url: str, max_tokens: int) -> tuple[float, str]:
    t = time.perf_counter()
    r = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "The capital of France is", "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True}, timeout=600)
    return time.perf_counter() - t, r.json()["choices"][0]["text"]


def costly(url: str) -> str:
    body = {"messages": [{"role": "user", "content": "Write a's"}], "max_tokens": 32,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": {"type": "string", "pattern": "^a{100000}$"}}}}
    r = httpx.post(f"{url}{CHAT}", json=body, timeout=600)
    return f"{r.status_code}: {r.json().get('error', {}).get('message', 'ok')[:100]}"


def schema_cache_rss() -> str:
    """RSS of this process before and after 20 schemas with a 5 MB description (the grammar source
    cache, in-process: a server refuses such schemas past --max-schema-bytes)."""
    import gc

    from tokenbudget import StructuredOutputsParams
    StructuredOutputsParams(json={"type": "integer"})
    gc.collect()
    before = rss_mb(os.getpid())[0]
    for i in range(20):
        StructuredOutputsParams(json={"type": "string", "description": f"{i}" + "d" * (5 << 20)})
    gc.collect()
    return f"20 schemas with a 5 MB description: RSS {before:.0f} -> {rss_mb(os.getpid())[0]:.0f} MB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--neighbour-only", action="store_true", help="only part 2 (runs on older servers too)")
    ap.add_argument("--schema-cache-only", action="store_true", help="only the in-process schema cache RSS")
    args = ap.parse_args()
    if args.schema_cache_only:
        print(schema_cache_rss())
        return
    body_cases = (("default limits", []), ("--max-request-bytes 64 MiB", ["--max-request-bytes", str(64 << 20)]))
    for label, extra in () if args.neighbour_only else body_cases:
        with server(extra, args.num_threads) as (url, pid):
            greedy(url, 4)
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS: the peak from here on
            before = rss_mb(pid)[0]
            latencies, answer = health_while(url, lambda: big_prompt(url))
            after, peak = rss_mb(pid)
            print(f"30 MB prompt, {label}: answered {answer}; /health max {max(latencies) * 1e3:.1f} ms, "
                  f"median {statistics.median(latencies) * 1e3:.1f} ms over {len(latencies)} polls; "
                  f"RSS {before:.0f} -> {after:.0f} MB, peak {peak:.0f} MB")
    with server([], args.num_threads) as (url, pid):
        greedy(url, 4)
        cheap = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "string", "pattern": "^b+$"}}}}
        httpx.post(f"{url}{CHAT}", json=cheap, timeout=600)  # the grammar backend is built once, not timed
        alone, beside, outcomes = [], [], []
        for _ in range(args.repeats):
            t, text = greedy(url, args.max_tokens)
            alone.append(t)
            threads = [threading.Thread(target=lambda: outcomes.append(costly(url))) for _ in range(3)]
            for th in threads:
                th.start()
            t2, text2 = greedy(url, args.max_tokens)
            for th in threads:
                th.join()
            beside.append(t2)
            assert text2 == text, "the neighbour's greedy text changed"
        a, b = statistics.median(alone), statistics.median(beside)
        print(f"neighbour greedy {args.max_tokens} tokens: alone {a:.2f} s, beside 3 x pattern a{{100000}} "
              f"{b:.2f} s (x{b / a:.2f}, median of {args.repeats}); text unchanged; the three got: "
              f"{sorted(set(outcomes))}")


if __name__ == "__main__":
    main()
