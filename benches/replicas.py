"""Output tokens/s of N ``tokenbudget serve`` replicas behind SMG (round_robin), same prompts.

    python benches/replicas.py --replicas 1 2 --num-prompts 32 --max-tokens 64 --concurrency 16

Each replica is a process with ``--num-threads 1`` on 127.0.0.1; the same SMG router sits in
front of every configuration, so the router's cost is in every row. Every replica gets one
warm-up request first. The load: ``--num-prompts`` greedy completions (``ignore_eos``, so every
request makes exactly ``--max-tokens`` tokens), at most ``--concurrency`` in flight. Prints a
table and writes ``benches/results/replicas.json``. Needs the [serve] and [router] extras.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} never answered 200")
        time.sleep(0.3)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


async def _load(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(prompt: str) -> int:
            async with sem:
                r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0,
                                                               "max_tokens": max_tokens, "ignore_eos": True})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens), time.perf_counter() - start


def run(n: int, prompts: list[str], args) -> dict:
    procs, urls = [], []
    try:
        for _ in range(n):
            port = _port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tokenbudget.cli.main", "serve", "--port", str(port), "--no-spec",
                 "--num-threads", "1", "--max-model-len", "512"],
                env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url, p in zip(urls, procs):
            _wait(url + "/health", p)
        router_port = _port()
        procs.append(subprocess.Popen([shutil.which("smg") or "smg", "launch", "--host", "127.0.0.1", "--port",
                                       str(router_port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                       str(_port()), "--policy", "round_robin", "--log-level", "warn",
                                       "--worker-urls", *urls], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        router = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 60
        while True:  # every worker registered and healthy
            try:
                ws = httpx.get(router + "/workers", timeout=2).json().get("workers", [])
                if sum(w.get("is_healthy", False) for w in ws) == n:
                    break
            except (httpx.TransportError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("SMG never registered the replicas")
            time.sleep(0.3)
        asyncio.run(_load(router, ["Warm up."] * n, 4, n))
        tokens, wall = asyncio.run(_load(router, prompts, args.max_tokens, args.concurrency))
        return {"replicas": n, "output_tokens": tokens, "wall_s": round(wall, 2),
                "output_tok_per_s": round(tokens / wall, 1)}
    finally:
        _stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    prompts = [f"Write a short note about harbour number {i}:" for i in range(args.num_prompts)]
    rows = [run(n, prompts, args) for n in args.replicas]
    base = rows[0]["output_tok_per_s"]
    print(f"{'replicas':>8} {'tokens':>7} {'wall s':>7} {'out tok/s':>10} {'vs first':>8}")
    for r in rows:
        print(f"{r['replicas']:>8} {r['output_tokens']:>7} {r['wall_s']:>7} {r['output_tok_per_s']:>10} "
              f"{r['output_tok_per_s'] / base:>7.2f}x")
    out = Path(__file__).parent / "results" / "replicas.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
