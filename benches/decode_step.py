"""Where one batch-1 decode step goes on the CPU: scheduler, input preparation, forward, LM head,
sampler, output processing and the glue between them (milliseconds per step, medians of repeats).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benches/decode_step.py --threads 1 --tokens 128 --repeats 3 \
        [--quantization auto] [--torch-profile] [--json out.json]

One chat-templated prompt, greedy, EOS ignored, no speculation, no prefix cache; the first step
(prefill) is excluded. ``--torch-profile`` adds torch.profiler's top ops over 16 decode forwards
(self CPU time per forward). The same file runs against an older checkout (copy it into its
``benches/``) for a before/after table in one sitting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benches.common import StepProfiler, machine_info, median, print_table, write_json  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."


def one_run(llm, tokens: int) -> dict[str, float]:
    from tokenbudget import SamplingParams

    eng = llm.engine
    eng.add_request("warm", PROMPT, SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
    eng.step()  # prefill + first token: not a decode step
    with StepProfiler(llm) as prof:
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        wall = time.perf_counter() - t
    n = prof.steps
    parts = {k: 1000 * v / n for k, v in prof.split().items() if abs(v) > 0}
    return {"step": 1000 * wall / n, **parts, "tok/s": n / wall}


def torch_profile(llm, tokens: int = 16) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    from tokenbudget import SamplingParams
    eng = llm.engine
    eng.add_request("prof", PROMPT, SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
    eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while eng.has_unfinished_requests():
            eng.step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    return [(e.key, e.self_cpu_time_total / 1000 / tokens, e.count // tokens) for e in rows]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from tokenbudget import LLM
    torch.set_num_threads(args.threads)
    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, quantization=args.quantization,
              kv_cache_memory_bytes=256 << 20)
    one_run(llm, 8)  # warm-up
    runs = [one_run(llm, args.tokens) for _ in range(args.repeats)]
    keys = list(runs[0])
    summary = {k: median([r.get(k, 0.0) for r in runs]) for k in keys}
    print_table(["part", "ms per decode step"],
                [[k, f"{v:.2f}"] for k, v in summary.items()])
    result = {"machine": machine_info(args.threads), "args": vars(args), "median": summary, "runs": runs}
    if args.torch_profile:
        ops = torch_profile(llm)
        print_table(["op", "self ms / forward", "calls / forward"], [[k, f"{ms:.3f}", c] for k, ms, c in ops])
        result["torch_profile"] = ops
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
