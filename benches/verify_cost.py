"""What a verify costs against a decode: one request's forward + logits for M new rows after C
cached tokens, on the engine's own runner and model (the default model, C kernels unless
``TOKENBUDGET_NATIVE`` says otherwise), best of ``--repeats`` calls per cell.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benches/verify_cost.py --threads 1 [--rows 1 2 3 5 9] \
        [--contexts 64 256 512 1024 2048] [--json out.json]

M = 1 is a decode step; M = 1 + k verifies k drafts. The ratio M / 1 is what speculation must
beat: a verify of k drafts pays when it commits more than (its cost / a decode's) tokens. The
context's blocks are filled with random K/V first (the values do not change the arithmetic's cost,
but pages of the pool never written would all be read as the kernel's one zero page, from cache,
and make long contexts look ~3x cheaper than in a real engine), and the rows write their own K/V
into blocks of the pool as a real step would.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benches.common import machine_info, print_table, write_json  # noqa: E402


def forward_seconds(runner, rows: int, context: int, repeats: int) -> float:
    """Best wall time of forward + logits for ``rows`` rows of one request after ``context`` keys."""
    bs, model = runner.block_size, runner.model
    n = context + rows
    blocks = list(range(1, (n + bs - 1) // bs + 1))
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(context, n)], dtype=torch.int64)
    ids = torch.randint(0, 1000, (rows,))
    pos = torch.arange(context, n)
    for kv in runner.kv_caches:  # real K/V in the context's blocks: pages never written all read as
        kv[blocks[0]:blocks[-1] + 1].uniform_(-1.0, 1.0)  # the one zero page, from cache, not memory
    best = float("inf")
    for _ in range(repeats):
        md = runner.attn_backend.build_metadata([0, rows], [n], [blocks], slots)
        t = time.perf_counter()
        model.compute_logits(model(ids, pos, md, runner.kv_caches))
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tokenbudget import LLM

    llm = LLM(num_threads=args.threads, enable_prefix_caching=False,
              max_model_len=max(args.contexts) + max(args.rows) + 16)
    runner = llm.engine.runner
    need = (max(args.contexts) + max(args.rows)) // runner.block_size + 2
    if runner.kv_caches[0].shape[0] < need:
        raise SystemExit(f"the KV pool has {runner.kv_caches[0].shape[0]} blocks, the longest cell needs {need}")
    cells = []
    for c in args.contexts:
        ms = {m: forward_seconds(runner, m, c, args.repeats) for m in args.rows}
        cells.append({"context": c, "ms": {m: 1e3 * s for m, s in ms.items()}})
    base = args.rows[0]
    headers = ["context"] + [f"M={m} ms" for m in args.rows] + [f"M={m} / M={base}" for m in args.rows[1:]]
    rows = [[c["context"]] + [f"{c['ms'][m]:.2f}" for m in args.rows]
            + [f"{c['ms'][m] / c['ms'][base]:.2f}" for m in args.rows[1:]] for c in cells]
    print(f"forward + logits, one request, best of {args.repeats}, {args.threads} thread(s), "
          f"kernels: {os.environ.get('TOKENBUDGET_NATIVE', 'default')}")
    print_table(headers, rows)
    result = {"machine": machine_info(args.threads), "kernels": os.environ.get("TOKENBUDGET_NATIVE", "default"),
              "cells": cells}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
