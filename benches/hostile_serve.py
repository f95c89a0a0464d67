"""What hostile requests cost the others: ``tokenbudget serve`` (default model) in a subprocess,
loaded from this process.

    PYTHONPATH=. python benches/hostile_serve.py --attacks all [--json out.json]   # issue 47
    PYTHONPATH=. python benches/hostile_serve.py [--num-threads 1] [--max-tokens 64]  # issue 22

``--attacks`` (issue 47; ``benches/hostile_attacks.py`` has them): for each attack a fresh server,
then a neighbour's greedy streams (``--neighbour-tokens`` each, one after another, so its context
and TPOT stay put) alone for a few seconds (its TPOT: the mean gap between its tokens), then the
attack for ``--window`` seconds (slow-loris: the time it holds its connections) while the
neighbour streams on and ``/health`` is polled from this process, then the neighbour alone
again: the neighbour's TPOT during the attack against alone (the mean of the windows before and
after: the machine's other load drifts), the longest ``/health`` answer (and how many failed),
what the attacker got, the server's RSS before, at its peak (``VmHWM``) and 3 s after the attack
is cut and the neighbour stopped. A gap that the attack's end cut short counts as it was (a
lower bound), so a frozen server shows as one long gap. ``none`` (first in ``all``) is the
control: the same windows, no attack. ``--server-python`` runs the server from another checkout
(the "before" column: main; run it from outside this checkout, whose ``tokenbudget`` folder
would shadow the other's). Timings are noisy on a shared machine: compare ratios.

Without ``--attacks`` (issue 22):
1. ``/health`` latency (polled every 20 ms from this process, so it includes this process's own
   sending of the body) while a 30 MB completion body is sent: with the
   default limits (413 from ``Content-Length``) and with ``--max-request-bytes`` raised to 64 MiB
   (the prompt's byte length refuses it before tokenizing: 400); the server's RSS before, after
   and at its peak (``VmHWM``).
2. A neighbour's greedy stream (``--max-tokens`` tokens, ``ignore_eos``) alone, then beside three
   chat requests whose JSON schema is the pattern ``^a{100000}$`` (mask ~20 ms per step on the
   49k vocabulary): its wall time side by side, and what the three got.
3. ``--schema-cache-only``: this process's RSS around 20 schemas with a 5 MB description.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(extra: list[str], num_threads: int, python: str = sys.executable, max_model_len: int = 2048,
           nofile: int | None = None):
    port = free_port()
    cmd = [python, "-m", "tokenbudget", "serve", "--port", str(port), "--num-threads", str(num_threads),
           "--max-model-len", str(max_model_len), "--no-spec", *extra]

    def limit_descriptors():
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=limit_descriptors,
                            env={**os.environ, "OMP_NUM_THREADS": str(num_threads)})
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
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:  # frozen (the old quadratic scan): it cannot even stop
            proc.kill()
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


# ------------------------------------------------------------------------------ issue 47: attacks
NEIGHBOUR = {"prompt": "The capital of France is", "temperature": 0, "ignore_eos": True, "stream": True}
CHEAP_STRUCTURED = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {
    "type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "string", "pattern": "^b+$"}}}}


class Neighbour(threading.Thread):
    """Greedy streams one after another until ``stop``; the arrival time of each token, per stream."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.stop, self.streams = url, max_tokens, threading.Event(), []

    def run(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                times: list[float] = []
                self.streams.append(times)
                with contextlib.suppress(httpx.HTTPError), client.stream(
                        "POST", f"{self.url}{COMPLETIONS}", json={**NEIGHBOUR, "max_tokens": self.max_tokens}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            times.append(time.perf_counter())
                        if self.stop.is_set():
                            break

    def tpot(self, start: float, end: float) -> float:
        """Mean gap between consecutive tokens, over the gaps that end inside [start, end]; the
        gap open at ``end`` counts up to ``end`` (a lower bound: a frozen server is one long gap)."""
        gaps = []
        for times in self.streams:
            for a, b in zip(times, times[1:]):
                if start <= b <= end:
                    gaps.append(b - a)
                elif start <= a <= end < b:
                    gaps.append(end - a)
            if times and times[-1] <= end and times is self.streams[-1] and self.is_alive():
                gaps.append(end - max(times[-1], start))  # still waiting for its next token at ``end``
        return statistics.mean(gaps) if gaps else float("nan")


class HealthPoller(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.latencies, self.failures = url, threading.Event(), [], 0

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                ok = httpx.get(f"{self.url}/health", timeout=30).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.latencies.append(time.perf_counter() - t)
            self.failures += not ok
            time.sleep(0.05)


def attack_row(name: str, args) -> dict:
    """One attack against a fresh server (see the module docstring); its figures. The neighbour's
    TPOT alone is measured before the attack and again after it (the mean of the two: the
    machine's other load drifts); ``none`` is the control, a window without an attack."""
    from hostile_attacks import ATTACKS, Sockets

    kwargs, window, nofile = {}, args.window, None
    if name == "tokenize":
        kwargs = {"prompt_bytes": args.max_model_len * 81 - 200}  # the default model: <= 81 bytes a token
    if name == "slow-loris":
        kwargs, window, nofile = {"hold": args.hold}, args.hold + 5, 256
    attack = ATTACKS.get(name, lambda addr, sockets: time.sleep(window - 1) or Counter())
    with server([], args.num_threads, args.server_python, args.max_model_len, nofile) as (url, pid):
        addr = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        greedy(url, 4)
        httpx.post(f"{url}{CHAT}", json=CHEAP_STRUCTURED, timeout=600)  # the grammar backend: built once, not counted
        neighbour = Neighbour(url, args.neighbour_tokens)
        neighbour.start()
        time.sleep(args.alone)
        before = (time.perf_counter() - args.alone + 0.5, time.perf_counter())
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the peak from here on
        rss_start = rss_mb(pid)[0]
        health, sockets, outcome = HealthPoller(url), Sockets(), []
        health.start()
        start = time.perf_counter()

        def attacking():  # the quick attacks again and again until the window ends
            got = attack(addr, sockets, **kwargs)
            while name not in ("grammar", "slow-loris", "none") and time.perf_counter() - start < window - 1:
                got += attack(addr, sockets, **kwargs)
            outcome.append(got)

        attacker = threading.Thread(target=attacking, daemon=True)
        attacker.start()
        attacker.join(window)
        end = time.perf_counter()
        health.stop.set()
        sockets.stopped = True
        for sock in list(sockets):  # cut whatever the attacker still holds
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        attacker.join(30)
        health.join(60)
        time.sleep(1 + args.alone)
        after = (time.perf_counter() - args.alone, time.perf_counter())
        neighbour.stop.set()
        time.sleep(3)
        rss_end, peak = rss_mb(pid)
        got = {str(k): v for k, v in outcome[0].items()} if outcome else "no answer within the window"
        alone = (neighbour.tpot(*before) + neighbour.tpot(*after)) / 2
        row = {"attack": name, "attacker": got, "tpot_alone_ms": alone * 1e3,
               "tpot_before_ms": neighbour.tpot(*before) * 1e3, "tpot_after_ms": neighbour.tpot(*after) * 1e3,
               "tpot_during_ms": neighbour.tpot(start, end) * 1e3, "window_s": end - start,
               "health_max_ms": max(health.latencies, default=float("nan")) * 1e3,
               "health_failures": health.failures, "health_polls": len(health.latencies),
               "rss_start_mb": rss_start, "rss_peak_mb": peak, "rss_end_mb": rss_end}
    row["tpot_ratio"] = row["tpot_during_ms"] / row["tpot_alone_ms"]
    return row


def print_rows(rows: list[dict]) -> None:
    print("| attack | attacker got | neighbour TPOT alone (before, after) -> during (ratio) "
          "| /health max (failed/polls) | RSS start / peak / end MB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['attack']} | {r['attacker']} | {r['tpot_alone_ms']:.1f} ({r['tpot_before_ms']:.0f}, "
              f"{r['tpot_after_ms']:.0f}) -> {r['tpot_during_ms']:.1f} ms "
              f"(x{r['tpot_ratio']:.2f}) | {r['health_max_ms']:.0f} ms ({r['health_failures']}/{r['health_polls']}) "
              f"| {r['rss_start_mb']:.0f} / {r['rss_peak_mb']:.0f} / {r['rss_end_mb']:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--neighbour-only", action="store_true", help="only part 2 (runs on older servers too)")
    ap.add_argument("--schema-cache-only", action="store_true", help="only the in-process schema cache RSS")
    ap.add_argument("--attacks", help="issue 47: 'all' or a comma list of benches/hostile_attacks.py's ATTACKS")
    ap.add_argument("--server-python", default=sys.executable, help="the Python whose tokenbudget serves")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--window", type=float, default=15.0, help="seconds each attack runs at most")
    ap.add_argument("--hold", type=float, default=35.0, help="seconds slow-loris holds its connections")
    ap.add_argument("--alone", type=float, default=4.0, help="seconds the neighbour streams alone first")
    ap.add_argument("--neighbour-tokens", type=int, default=256,
                    help="tokens per neighbour stream (then a new one: its TPOT grows with its length)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.attacks:
        from hostile_attacks import ATTACKS
        names = ["none", *ATTACKS] if args.attacks == "all" else args.attacks.split(",")
        rows = []
        for name in names:
            rows.append(attack_row(name, args))
            print_rows(rows[-1:])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"server_python": args.server_python, "rows": rows}, f, indent=1, default=str)
        return
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
        httpx.post(f"{url}{CHAT}", json=CHEAP_STRUCTURED, timeout=600)  # the grammar backend is built once, not timed
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
