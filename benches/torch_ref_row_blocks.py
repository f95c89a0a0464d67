"""Cost of the CPU reference attention's 4-row GEMM blocks (kernels/attention/torch_ref.py).

A/B in one process, interleaved: the reference as it is (every GEMM exactly 4 rows) vs the same
code with one whole-M ``bmm`` per GEMM (what it did before issue 26: fast, but a row's bits then
depend on the BLAS's kernel choice for M). Attention of one layer, default model's head layout
(9 heads, 3 kv heads, head_dim 64), fp32; median microseconds.

    PYTHONPATH=. python benches/torch_ref_row_blocks.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tokenbudget.kernels.attention import torch_ref  # noqa: E402
from tokenbudget.kernels.attention.base import AttentionSpec  # noqa: E402

from benches.gpu_check_attention import Pool  # noqa: E402

CASES = {"decode, ctx 1000": [(1, 1000)], "verify k=4, ctx 1000": [(5, 1000)],
         "8 decodes, ctx 500": [(1, 500)] * 8, "prefill 256": [(256, 256)], "prefill 512": [(512, 512)]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = AttentionSpec(9, 3, 64, 16, torch.float32)
    blocked = torch_ref._bmm_row_blocks
    variants = {"4-row blocks": blocked, "whole M": lambda a, b: torch.bmm(a, b)}
    print("| case | 4-row blocks (us) | whole M (us) | ratio | bitwise equal here |")
    print("|---|---|---|---|---|")
    for name, reqs in CASES.items():
        pool = Pool(spec, sum(-(-kv // 16) + 1 for _, kv in reqs) + 1, "cpu", 0)
        tables = [pool.request(kv) for _, kv in reqs]
        qo, kvs, slots = [0], [], []
        for (q, kv), t in zip(reqs, tables):
            qo.append(qo[-1] + q)
            kvs.append(kv)
            slots += [t[i // 16] * 16 + i % 16 for i in range(kv - q, kv)]
        backend = torch_ref.TorchRefBackend(spec, "cpu")
        md = backend.build_metadata(qo, kvs, tables, torch.tensor(slots))
        q = pool.rand(qo[-1], 9, 64)
        times = {k: [] for k in variants}
        outs = {}
        for _ in range(args.iters):
            for k, fn in variants.items():
                torch_ref._bmm_row_blocks = fn
                t0 = time.perf_counter()
                outs[k] = backend.attend(q, pool.cache, md)
                times[k].append(time.perf_counter() - t0)
        torch_ref._bmm_row_blocks = blocked
        b, w = (statistics.median(times[k][2:]) * 1e6 for k in variants)
        print(f"| {name} | {b:.0f} | {w:.0f} | {b / w:.2f} | {torch.equal(*outs.values())} |")


if __name__ == "__main__":
    main()
