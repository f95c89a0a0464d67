"""CPU weight-only quantized GEMM kernels vs the fp32 oneDNN path: speed and bitwise row invariance.

For each linear shape of the default model (SmolLM2-135M: hidden 576, intermediate 1536, vocab
49152) and each M in 1, 4, 5, 8, 64 (rows padded to the kernel's ``row_multiple`` like
``DecoderLM``: 4 for fp32, none for the quantized kernels, whose rows are invariant at any
M): median ms per call, and whether every row of the M-row call equals, bit for bit, the same row
computed alone. Kernels:
  fp32    oneDNN prepacked fp32 linear (today's path, ``layers.Linear``)
  int8    ``aten._weight_int8pack_mm`` (int8 weight, per-output-channel fp32 scales)
  int4gG  ``aten._weight_int4pack_mm_for_cpu`` (asymmetric 4-bit, group size G)
  int8 C, int4g32 C  our C kernels (``kernels/cpu``; fp32 activations, quantized to int8 inside)
(quantized kernels take bf16 activations by default, ``--act float32`` for fp32 ones). Weights are
reused call after call, so a shape's weights sit in cache: this favours fp32 (the model's 540 MB
of fp32 weights do not fit); ``benches/quant_quality.py`` measures whole-model decode.
Run: ``OMP_NUM_THREADS=1 python benches/quant_kernels.py [--threads 1] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenbudget.engine.model.layers import Linear, pad_rows
from tokenbudget.engine.model.quant import QuantLinear
from tokenbudget.kernels.cpu import quant_gemm as cpu_gemm

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def kernels(w: torch.Tensor, act: torch.dtype):
    yield "fp32", Linear(w)
    yield "int8", QuantLinear.from_float(w, "int8", act_dtype=act, kernel="torch")
    for g in (32, 64, 128):
        if w.shape[1] % g == 0:  # 576 is not a multiple of 128
            yield f"int4g{g}", QuantLinear.from_float(w, "int4", group_size=g, act_dtype=act, kernel="torch")
    if cpu_gemm.supports(w.shape[1]):
        yield "int8 C", QuantLinear.from_float(w, "int8", kernel="native")
        yield "int4g32 C", QuantLinear.from_float(w, "int4", kernel="native")


def padded(fn, x: torch.Tensor) -> torch.Tensor:
    m = x.shape[0]
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad_rows(m, fn.row_multiple) - m))
    return fn(xp)[:m]


def time_ms(fn, x, reps: int) -> float:
    for _ in range(3):
        padded(fn, x)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        padded(fn, x)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def invariant(fn, x: torch.Tensor) -> bool:
    full = padded(fn, x)
    return all(torch.equal(full[i], padded(fn, x[i:i + 1])[0]) for i in range(x.shape[0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ms", default="1,4,5,8,64")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--act", default="bfloat16", choices=["bfloat16", "float32"],
                    help="activation dtype fed to the quantized kernels (fp32 is unvectorized)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ms = [int(m) for m in args.ms.split(",")]
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=g) * 0.05
            for kname, fn in kernels(w, getattr(torch, args.act)):
                for m in ms:
                    x = torch.randn(m, k, generator=g)
                    reps = 20 if n > 10000 else 100
                    rows.append({"shape": name, "N": n, "K": k, "kernel": kname, "M": m,
                                 "ms": round(time_ms(fn, x, reps), 4),
                                 "row_invariant": invariant(fn, x)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"threads={args.threads}, quantized kernels' activations {args.act}; "
          "ms per call (rows padded to a multiple of 4); inv = every row "
          "bitwise equal to the row alone")
    kn = list(dict.fromkeys(r["kernel"] for r in rows))
    print(f"{'shape':8} {'M':>3} " + " ".join(f"{k:>14}" for k in kn))
    for name in SHAPES:
        for m in ms:
            cells = []
            for k in kn:
                r = [r for r in rows if r["shape"] == name and r["M"] == m and r["kernel"] == k]
                cells.append(f"{r[0]['ms']:8.3f} {'inv' if r[0]['row_invariant'] else 'VAR':>5}"
                             if r else "-")
            print(f"{name:8} {m:>3} " + " ".join(f"{c:>14}" for c in cells))
    total = {k: sum(r["ms"] for r in rows if r["kernel"] == k and r["M"] == 1) for k in kn
             if sum(r["kernel"] == k and r["M"] == 1 for r in rows) == len(SHAPES)}
    print("sum over shapes at M=1 (one layer + lm_head; kernels covering every shape), ms: "
          + ", ".join(f"{k} {v:.3f}" for k, v in total.items()))


if __name__ == "__main__":
    main()
