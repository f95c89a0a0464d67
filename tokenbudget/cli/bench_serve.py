"""``tokenbudget bench serve``: load-test an OpenAI-compatible server, like ``vllm bench serve``.

    tokenbudget bench serve --url http://127.0.0.1:8000 --dataset question.jsonl --concurrency 16
    tokenbudget bench serve --model model.gguf --dataset prompts.jsonl --request-rate 4 \\
        --output-json out.json --output-png out.png

``--url`` targets a running server; without it a local ``tokenbudget serve`` is started in this
process (``--model``, default: the default model; speculation flags as in ``generate``). Prompts
are JSONL (Spec-Bench questions, ``{"prompt": ...}``, ``{"messages": ...}``). Prints throughput,
TTFT/TPOT/ITL/e2e percentiles and acceptance by position; writes them as JSON and a PNG.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from tokenbudget.cli.generate import SPEC_METHODS, num_spec_tokens, speculative_config_from_args


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("serve", help="load-test an OpenAI-compatible server")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", help="base URL of a running server (e.g. http://127.0.0.1:8000)")
    target.add_argument("--model", help="start a local server on this model (default: the default model)")
    p.add_argument("--dataset", required=True, help="JSONL prompts (Spec-Bench question.jsonl, prompt/messages)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--output-png", default=None)
    p.add_argument("--spec-method", choices=SPEC_METHODS)
    p.add_argument("--spec-model", default=None,
                   help="a draft model (draft_model) or an EAGLE-3 head directory (eagle3)")
    p.add_argument("--num-spec-tokens", type=num_spec_tokens, default="auto")
    p.add_argument("--speculative-config", default=None)
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.set_defaults(run=run)


@contextlib.contextmanager
def local_server(args):
    """A ``tokenbudget serve`` in a thread of this process; yields its base URL."""
    from tokenbudget.engine.entrypoints.async_llm import AsyncLLM
    from tokenbudget.engine.serve.server import server_in_thread, server_url
    options = {k: getattr(args, k) for k in ("num_threads", "max_num_seqs", "max_model_len")
               if getattr(args, k) is not None}
    llm = AsyncLLM(args.model, speculative_config=speculative_config_from_args(args), **options)
    with server_in_thread(llm, "local", start_timeout=600, log_level="warning") as server:
        yield server_url(server)


def run(args) -> int:
    from tqdm import tqdm

    from tokenbudget.engine.serve import bench
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    prompts = bench.load_prompts(args.dataset, args.num_prompts)
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    with contextlib.ExitStack() as stack:
        url = args.url.rstrip("/") if args.url else stack.enter_context(local_server(args))
        before = bench.scrape_spec(url, args.api_key)
        with tqdm(total=len(prompts), desc="requests", unit="req") as bar:
            results, wall = asyncio.run(bench.run_load(url, prompts, body, args.request_rate, args.concurrency,
                                                       args.api_key, args.seed, bar))
        summary = bench.summarize(results, wall, before, bench.scrape_spec(url, args.api_key))
    summary["config"] = {k: v for k, v in vars(args).items() if k != "run" and k != "api_key"}
    print(bench.format_summary(summary))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, default=str)
    if args.output_png:
        bench.plot(results, summary, args.output_png)
    return 0 if summary["failed"] == 0 else 1
