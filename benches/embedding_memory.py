"""Resident memory of ``LLM()`` on the default model with the token embedding as Q8_0 rows
(``Q8Embedding``, the default) vs the fp32 table, after one short greedy generation.

    PYTHONPATH=. python benches/embedding_memory.py            # both, interleaved, 2 rounds
    PYTHONPATH=. python benches/embedding_memory.py --json out.json

Each measurement runs in its own process (``--one float|q8``): RSS is per process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one(mode: str, max_tokens: int) -> dict:
    import gc

    import torch
    torch.set_num_threads(1)
    if mode == "float":
        from tokenbudget.engine.model import quant
        quant.Q8Embedding.exact_from = classmethod(lambda cls, table: None)
    from tokenbudget import LLM, SamplingParams
    llm = LLM()
    out = llm.generate(["Write a haiku about the sea."], SamplingParams(max_tokens=max_tokens, temperature=0))
    gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return {"embedding": mode, "rss_mb": round(_rss_mb()), "peak_rss_mb": peak, "text": out[0].outputs[0].text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one", choices=["float", "q8"], help="measure one mode in this process (internal)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.max_tokens)))
        return
    rows = []
    for _ in range(args.rounds):
        for mode in ("float", "q8"):
            res = subprocess.run([sys.executable, __file__, "--one", mode, "--max-tokens", str(args.max_tokens)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"{'embedding':10} {'RSS MB':>8} {'peak MB':>8}  text")
    for r in rows:
        print(f"{r['embedding']:10} {r['rss_mb']:>8} {r['peak_rss_mb']:>8}  {r['text'][:40]!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
