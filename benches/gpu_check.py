"""One command for the first GPU: everything the CUDA path has never been proven to do.

    PYTHONPATH=. python benches/gpu_check.py --device cuda --out benches/results/gpu_check

Sections (each records its own status; one failing section does not stop the others):

1. ``cuda_tests``: ``pytest -m cuda`` over the CUDA test files (FlashInfer, graphs, Triton);
2. ``backend_vs_ref``: the selected attention backend vs torch_ref on mixed/decode/verify batches;
3. ``row_invariance``: decode vs verify rows (k = 1, 3, 4, 8; contexts 100/1000/6000), alone
   vs in a mixed batch, bitwise, in default and deterministic modes;
4. ``graph_vs_eager``: CUDA-graph replay vs the eager forward (uniform and padded-draft verifies);
5. ``verify_cost``: ms of one verify step, k = 0..8 at B = 1, 8, 32 (goal: k = 4 <= 1.1x k = 0
   at B = 1);
6. ``spec_equiv``: greedy speculation (oracle drafter, k = 4) token-identical to plain decoding
   on each ``--models`` shape, default and deterministic modes.

Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md``. ``--device cpu`` runs the same report
on the torch_ref backend (sections 4 reports "skipped": graphs need CUDA), which CI does with
tiny sizes (``tests/test_gpu_check.py``). Budget on one H100: the FlashInfer JIT (~1 min with
the RECIPE variables) plus a few minutes; sizes are arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tokenbudget.kernels.attention.base import AttentionSpec  # noqa: E402
from tokenbudget.kernels.attention.selector import select_attention_backend  # noqa: E402

from benches.common import machine_info, markdown_table  # noqa: E402
from benches.gpu_check_attention import backend_vs_reference, row_invariance  # noqa: E402
from benches.gpu_spec import bench_verify, run_generation  # noqa: E402
from benches.synthetic_model import SHAPES, OracleProposer, build_synthetic_engine  # noqa: E402

CUDA_TEST_FILES = ["tests/test_flashinfer_backend.py", "tests/test_cuda_graphs.py",
                   "tests/test_triton_kv_write.py", "tests/test_batch_invariant_matmul.py",
                   "tests/test_triton_rejection.py"]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def section_cuda_tests(args) -> dict:
    if not args.pytest:
        return {"status": "skipped (--no-pytest)"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                          *CUDA_TEST_FILES], cwd=root, capture_output=True, text=True, check=False)
    tail = res.stdout.strip().splitlines()[-1:] or [""]
    return {"status": "ok" if res.returncode in (0, 5) else "failed", "returncode": res.returncode,
            "summary": tail[0], "output_tail": res.stdout[-4000:]}


def _spec(args) -> AttentionSpec:
    cfg = SHAPES[args.attn_shape]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    return AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim,
                         16, dtype)


def section_backend_vs_ref(args) -> dict:
    rows = backend_vs_reference(_spec(args), torch.device(args.device))
    return {"status": "ok" if all(r["ok"] for r in rows) else "failed", "rows": rows}


def section_row_invariance(args) -> dict:
    rows = []
    for det in (False, True):
        rows += row_invariance(_spec(args), torch.device(args.device), args.ks, args.contexts, det)
    det_ok = all(r["decode_eq_verify_row0"] and r["verify_alone_eq_mixed"] for r in rows if r["deterministic"])
    return {"status": "ok" if det_ok else "failed", "rows": rows}


def _engine(args, shape: str, deterministic: bool, **kw):
    dev = torch.device(args.device)
    eng = build_synthetic_engine(shape, dev, args.dtype, kv_bytes=args.kv_mib << 20, **kw)
    if deterministic:
        from tokenbudget.engine.worker.deterministic import apply_deterministic_mode
        apply_deterministic_mode(eng.model, dev)
        eng.runner.attn_backend = select_attention_backend(dev, eng.runner.attn_backend.spec,
                                                           deterministic=True)
    return eng


def section_graph_vs_eager(args) -> dict:
    if args.device != "cuda":
        return {"status": "skipped (CUDA graphs need a GPU and FlashInfer)"}
    from tokenbudget.engine.worker.cuda_graphs import CUDAGraphRunner
    eng = _engine(args, args.models[0], False, max_num_seqs=8)
    be = eng.runner.attn_backend
    if not hasattr(be, "graph_state"):
        return {"status": f"skipped (backend {be.name} has no graphs)"}
    runner = CUDAGraphRunner(eng.model, eng.runner.kv_caches, be, batch_sizes=(1, 2, 4, 8),
                             draft_lens=(0, 4), max_pages_per_req=64)
    t = time.perf_counter()
    runner.capture()
    rows = [{"capture_s": time.perf_counter() - t}]
    rng = random.Random(0)
    for q_lens in ([1, 1, 1], [5, 5], [5, 2, 1, 3]):
        bs = be.spec.block_size
        qo, kv, tables, pos, slots, nb = [0], [], [], [], [], 0
        for i, ql in enumerate(q_lens):
            c = 50 + 40 * i
            tables.append(list(range(nb, nb + -(-c // bs))))
            nb += len(tables[-1])
            qo.append(qo[-1] + ql)
            kv.append(c)
            pos += list(range(c - ql, c))
            slots += [tables[-1][p // bs] * bs + p % bs for p in range(c - ql, c)]
        dev = be.device
        ids = torch.tensor([rng.randrange(eng.model_config.vocab_size) for _ in pos], device=dev)
        pos_t, slot_t = torch.tensor(pos, device=dev), torch.tensor(slots, device=dev)
        caches = eng.runner.kv_caches
        snap = [c.clone() for c in caches]
        want = eng.model(ids, pos_t, be.build_metadata(qo, kv, tables, slot_t), caches).clone()
        for c, s in zip(caches, snap):
            c.copy_(s)
        got = runner(ids, pos_t, be.build_metadata(qo, kv, tables, slot_t), caches).clone()
        rows.append({"q_lens": q_lens, "bitwise_equal": bool(torch.equal(got, want)),
                     "max_abs_diff": (got.float() - want.float()).abs().max().item()})
    ok = all(r.get("bitwise_equal", True) for r in rows)
    return {"status": "ok" if ok else "differs", "rows": rows}


def section_verify_cost(args) -> dict:
    eng = _engine(args, args.models[-1], False, max_num_seqs=max(args.verify_batches))
    rows = bench_verify(eng, args.verify_batches, list(range(0, args.max_k + 1)), args.context,
                        args.iters, 2, seed=0)
    k4 = [r["ratio_to_k0"] for r in rows if r["batch"] == 1 and r["k"] == 4]
    return {"status": "ok", "k4_over_k0_at_b1": k4[0] if k4 else None,
            "goal_met": bool(k4 and k4[0] <= 1.1), "rows": rows}


def section_spec_equiv(args) -> dict:
    rows = []
    for shape in args.models:
        for det in (False, True):
            eng = _engine(args, shape, det, max_num_seqs=args.batch)
            rng = random.Random(1)
            prompts = [[rng.randrange(eng.model_config.vocab_size) for _ in range(args.prompt_len)]
                       for _ in range(args.batch)]
            eng.set_speculator(None)
            ref, *_ = run_generation(eng, prompts, args.max_tokens)
            refs = {f"r{i}": t for i, t in enumerate(ref)}
            eng.set_speculator(OracleProposer(1.0, eng.model_config.vocab_size, refs), 4)
            out, *_ = run_generation(eng, prompts, args.max_tokens)
            rows.append({"model": shape, "deterministic": det, "identical": out == ref,
                         "requests": len(prompts), "tokens": sum(map(len, ref))})
    ok = all(r["identical"] for r in rows if r["deterministic"])
    return {"status": "ok" if ok else "failed", "rows": rows}


SECTIONS = {"cuda_tests": section_cuda_tests, "backend_vs_ref": section_backend_vs_ref,
            "row_invariance": section_row_invariance, "graph_vs_eager": section_graph_vs_eager,
            "verify_cost": section_verify_cost, "spec_equiv": section_spec_equiv}


def markdown(report: dict) -> str:
    lines = [f"# GPU check ({report['device']})", "", f"machine: `{json.dumps(report['machine'])}`", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']}", ""]
        extra = {k: v for k, v in sec.items() if k not in ("status", "rows", "output_tail")}
        if extra:
            lines += [f"`{json.dumps(extra, default=str)}`", ""]
        rows = sec.get("rows") or []
        if rows:
            headers = list(rows[-1])
            lines += [markdown_table(headers, [[r.get(h, "") for h in headers] for r in rows]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--models", default="smollm2,8b",
                   help="synthetic shapes for spec_equiv (benches/synthetic_model.py; smollm2 = the default "
                        "model's shape, random weights)")
    p.add_argument("--attn-shape", default="8b", help="head layout for the attention sections")
    p.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--ks", type=_ints, default=[1, 3, 4, 8])
    p.add_argument("--contexts", type=_ints, default=[100, 1000, 6000])
    p.add_argument("--verify-batches", type=_ints, default=[1, 8, 32])
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--context", type=int, default=1000, help="verify_cost context")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="spec_equiv requests")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-mib", type=int, default=8192)
    p.add_argument("--no-pytest", dest="pytest", action="store_false")
    p.add_argument("--sections", default=",".join(SECTIONS))
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "machine": machine_info(torch.get_num_threads()), "args": vars(args), "sections": {}}
    for name in args.sections.split(","):
        t = time.perf_counter()
        try:
            sec = SECTIONS[name](args)
        except Exception as e:  # noqa: BLE001 - record and go on to the next section
            sec = {"status": f"error: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        sec["seconds"] = round(time.perf_counter() - t, 2)
        report["sections"][name] = sec
        print(f"{name}: {sec['status']} ({sec['seconds']} s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(markdown(report))
    return report


if __name__ == "__main__":
    main()
