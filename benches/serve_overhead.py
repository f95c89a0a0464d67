"""Server overhead: the same prompts at the same concurrency through ``tokenbudget serve`` (HTTP,
JSON, SSE) and through ``AsyncLLM`` directly, side by side in one run.

    PYTHONPATH=. python benches/serve_overhead.py --num-prompts 32 --concurrency 8 --max-tokens 48

Both sides run the same model object, engine options and greedy requests (``ignore_eos``, so
every request makes exactly ``--max-tokens`` tokens), each on a fresh engine (cold prefix cache).
Direct: asyncio tasks in this process iterate ``AsyncLLM.chat`` streams (DELTA). Server: the app
under uvicorn in a thread of this process, loaded by ``tokenbudget bench serve --url`` in a
separate client process (so the client's parsing does not share the server's GIL). Sides
alternate per repeat. (That greedy answers are identical through the server is what
tests/test_serve.py checks.) Compare the ratios: the machine is shared and absolute figures move
with its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenbudget import AsyncLLM, RequestOutputKind, SamplingParams  # noqa: E402
from tokenbudget.engine.loader.target import load_target_model  # noqa: E402
from tokenbudget.engine.serve import bench  # noqa: E402
from tokenbudget.engine.serve.server import server_in_thread, server_url  # noqa: E402

from benches.workloads import SPEC_BENCH  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "serve_overhead.json")


def engine_options(args) -> dict:
    return {"num_threads": args.threads, "max_model_len": 2048, "max_num_seqs": args.concurrency,
            "kv_cache_memory_bytes": 256 << 20}


async def direct(llm: AsyncLLM, prompts: list[bench.Prompt], args) -> tuple[list[bench.RequestResult], float]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(p: bench.Prompt) -> bench.RequestResult:
        async with gate:
            res, pieces = bench.RequestResult(ok=False), []
            start = last = time.perf_counter()
            async for out in llm.chat(p.messages, params):
                c = out.outputs[0]
                res.output_tokens += len(c.token_ids)
                res.prompt_tokens = len(out.prompt_token_ids)
                if c.text:
                    now = time.perf_counter()
                    if not pieces:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    pieces.append(c.text)
            res.e2e, res.text, res.ok = time.perf_counter() - start, "".join(pieces), True
            return res

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return list(results), time.perf_counter() - start


def through_server(target, prompts_file: str, args) -> dict:
    llm = AsyncLLM(target, **engine_options(args))
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    try:
        with server_in_thread(llm, "bench", log_level="warning") as server:
            subprocess.run([sys.executable, "-m", "tokenbudget.cli.main", "bench", "serve", "--url",
                            server_url(server), "--dataset", prompts_file, "--num-prompts", str(args.num_prompts),
                            "--max-tokens", str(args.max_tokens), "--ignore-eos", "--concurrency",
                            str(args.concurrency), "--output-json", out], check=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=SPEC_BENCH)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    prompts = bench.load_prompts(args.dataset, args.num_prompts)
    prompts = [p if p.messages is not None else bench.Prompt(messages=[{"role": "user", "content": p.text}])
               for p in prompts]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for p in prompts:
            f.write(json.dumps({"messages": p.messages}) + "\n")
        prompts_file = f.name
    target = load_target_model(None, dtype="float32", device="cpu")
    runs: dict[str, list[dict]] = {"direct": [], "server": []}
    for rep in range(args.repeats):
        for side in (("direct", "server") if rep % 2 == 0 else ("server", "direct")):
            if side == "direct":
                llm = AsyncLLM(target, **engine_options(args))
                results, wall = asyncio.run(direct(llm, prompts, args))
                summary = bench.summarize(results, wall)
            else:
                summary = through_server(target, prompts_file, args)
            runs[side].append(summary)
            print(f"[rep {rep} {side}] {summary['output_token_throughput']:.1f} tok/s, "
                  f"TTFT p50 {summary['ttft_s']['p50'] * 1e3:.0f} ms, wall {summary['wall_s']:.1f}s", flush=True)
    os.unlink(prompts_file)
    report(runs, args)


def _med(runs: list[dict], key: str, sub: str | None = None) -> float:
    return statistics.median(r[key][sub] if sub else r[key] for r in runs)


def report(runs: dict, args) -> None:
    rows = [("output tok/s", "output_token_throughput", None), ("req/s", "request_throughput", None),
            ("TTFT p50 (ms)", "ttft_s", "p50"), ("TTFT p90 (ms)", "ttft_s", "p90"),
            ("TPOT p50 (ms)", "tpot_s", "p50"), ("ITL p50 (ms)", "itl_s", "p50"), ("e2e p50 (s)", "e2e_s", "p50")]
    lines = [f"serve overhead: {args.num_prompts} Spec-Bench prompts, concurrency {args.concurrency}, "
             f"max_tokens {args.max_tokens}, {args.repeats} repeats (medians)", "",
             "| metric | direct AsyncLLM | through the server | server / direct |", "|---|---|---|---|"]
    for label, key, sub in rows:
        d, s = _med(runs["direct"], key, sub), _med(runs["server"], key, sub)
        scale = 1e3 if "(ms)" in label else 1.0
        lines.append(f"| {label} | {d * scale:.1f} | {s * scale:.1f} | {s / d:.3f} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"config": vars(args), "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
