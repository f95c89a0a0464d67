"""Grammar masks beside the forward pass vs before it (``engine.structured.mask_overlap``).

The default model, greedy, one torch thread (the masks' thread has the second core), a batch of
``--structured`` requests whose regex masks cost about a millisecond each (``x{N}``: llguidance
walks the long repetition for every mask; within the default per-step budgets, so the step is
one the overlap takes) beside ``--plain`` unconstrained requests. Two configurations, interleaved
round by round in one process: ``before`` (every step's masks computed before the forward, as
until 2026-11-28) and ``beside``. Per configuration: decode ms per step (wall time of the
generate call over the steps it took), mask ms per step (``StructuredOutputs.mask_seconds``),
the share of steps whose masks ran beside the forward, and ``identical`` (every token equal to
``before``'s; any "no" is a bug). Prints a table, writes JSON.

    OMP_NUM_THREADS=1 python benches/mask_overlap.py --json benches/results/mask_overlap.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.common import machine_info, print_table, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--structured", type=int, default=3)
    ap.add_argument("--plain", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5000, help="N of the regex x{N}")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from tokenbudget import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM(None, num_threads=1, kv_cache_memory_bytes=128 << 20, max_model_len=1024)
    core = llm.engine.core
    prompts = ([f"Write the letter x {i + 5} times:" for i in range(args.structured)]
               + [f"Tell me about the number {i + 7}." for i in range(args.plain)])
    params = ([SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                              structured_outputs=StructuredOutputsParams(regex=f"x{{{args.repeat}}}"))]
              * args.structured + [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)]
              * args.plain)
    fits = core.masks._fits
    figures = {name: {"seconds": 0.0, "steps": 0, "mask_seconds": 0.0, "beside": 0, "tokens": None}
               for name in ("before", "beside")}
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: the grammar backend, the kernels
    for _ in range(args.rounds):
        for name in ("before", "beside"):
            core.masks._fits = fits if name == "beside" else (lambda sched: False)
            f = figures[name]
            mask0, beside0 = core.structured.mask_seconds, core.masks.steps_beside
            calls = {"n": 0}
            real_step = llm.engine.step

            def counted():
                calls["n"] += 1
                return real_step()
            llm.engine.step = counted
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            f["seconds"] += time.perf_counter() - t0
            llm.engine.step = real_step
            f["steps"] += calls["n"]
            f["mask_seconds"] += core.structured.mask_seconds - mask0
            f["beside"] += core.masks.steps_beside - beside0
            tokens = [o.outputs[0].token_ids for o in outs]
            f["tokens"] = tokens if f["tokens"] in (None, tokens) else "changed between rounds"
    core.masks._fits = fits
    rows, out = [], {"machine": machine_info(1), "args": vars(args), "configs": {}}
    base = figures["before"]["seconds"] / figures["before"]["steps"]
    for name, f in figures.items():
        per_step = f["seconds"] / f["steps"]
        same = f["tokens"] == figures["before"]["tokens"]
        rows.append([name, f["steps"], f"{per_step * 1e3:.2f}", f"{f['mask_seconds'] / f['steps'] * 1e3:.2f}",
                     f"{f['beside'] / f['steps']:.0%}", f"{base / per_step:.2f}x", "yes" if same else "no"])
        out["configs"][name] = {"steps": f["steps"], "ms_per_step": per_step * 1e3,
                                "mask_ms_per_step": f["mask_seconds"] / f["steps"] * 1e3,
                                "share_beside": f["beside"] / f["steps"], "identical": same}
    print_table(["config", "steps", "ms/step", "mask ms/step", "beside", "speed vs before", "identical"], rows)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
