"""Engine-level sections of ``benches/gpu_check.py``: CUDA-graph replay vs eager, verify cost,
greedy speculation vs plain decoding. Each takes the parsed arguments and returns a section dict
(``status`` plus rows); the attention-level sections are in ``gpu_check_attention.py``.
"""

from __future__ import annotations

import random
import time

import torch

from benches.gpu_spec import bench_verify, run_generation
from benches.synthetic_model import SHAPES, OracleProposer, apply_engine_modes, build_synthetic_engine, param_count

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def memory_refusal(args, shape: str) -> str:
    """Why ``shape`` with ``--kv-mib`` would not fit the device's free memory ("" when it fits):
    weights (one copy, generated on the device) plus the KV pool, against MemAvailable on CPU
    (an 8B shape in fp32 is 32 GB: the OOM killer took a 24 GB machine at 21 GB) or the free
    GPU memory."""
    need = param_count(SHAPES[shape]) * _BYTES[args.dtype] + (args.kv_mib << 20)
    if args.device == "cuda":
        have = torch.cuda.mem_get_info()[0]
    else:
        with open("/proc/meminfo") as f:
            have = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable"))
    if need > 0.8 * have:
        return (f"--models {shape} needs ~{need / 2**30:.1f} GiB ({args.dtype} weights + "
                f"--kv-mib {args.kv_mib}), {have / 2**30:.1f} GiB free on {args.device}: "
                "pass a smaller shape or --kv-mib")
    return ""


def build_engine(args, shape: str, deterministic: bool, **kw):
    why = memory_refusal(args, shape)
    if why:
        raise ValueError(why)
    dev = torch.device(args.device)
    eng = build_synthetic_engine(shape, dev, args.dtype, kv_bytes=args.kv_mib << 20, **kw)
    apply_engine_modes(eng, deterministic=deterministic)
    return eng


def _graph_step(eng, be, q_lens: list[int], rng: random.Random):
    bs, dev = be.spec.block_size, be.device
    qo, kv, tables, pos, slots, nb = [0], [], [], [], [], 0
    for i, ql in enumerate(q_lens):
        c = 50 + 40 * i
        tables.append(list(range(nb, nb + -(-c // bs))))
        nb += len(tables[-1])
        qo.append(qo[-1] + ql)
        kv.append(c)
        pos += list(range(c - ql, c))
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(c - ql, c)]
    ids = torch.tensor([rng.randrange(eng.model_config.vocab_size) for _ in pos], device=dev)
    return qo, kv, tables, ids, torch.tensor(pos, device=dev), torch.tensor(slots, device=dev)


# (case, q_lens): a uniform step fills its bucket's L; a padded one has fewer drafts somewhere
GRAPH_CASES = [("uniform", [1, 1, 1]), ("uniform", [5, 5]), ("padded", [5, 2, 1, 3]),
               ("padded", [2, 2])]


def graph_vs_eager_status(rows: list[dict]) -> str:
    """Uniform buckets are planned exactly like eager: bitwise, both modes. A padded step runs the
    bucket's tile: it may differ in default mode (by design), never in deterministic mode."""
    must = [r for r in rows if r["case"] == "uniform" or r["deterministic"]]
    if not all(r["bitwise_equal"] for r in must):
        return "failed"
    if all(r["bitwise_equal"] for r in rows):
        return "ok"
    return "ok (default-mode padded steps differ: the bucket's tile, by design)"


def section_graph_vs_eager(args) -> dict:
    if args.device != "cuda":
        return {"status": "skipped (CUDA graphs need a GPU and FlashInfer)"}
    from tokenbudget.engine.worker.cuda_graphs import CUDAGraphRunner
    rows = []
    for det in (False, True):
        eng = build_engine(args, args.models[0], det, max_num_seqs=8)
        be = eng.runner.attn_backend
        if not hasattr(be, "graph_state"):
            return {"status": f"failed (backend {be.name} has no graphs)"}
        runner = CUDAGraphRunner(eng.model, eng.runner.kv_caches, be, batch_sizes=(1, 2, 4, 8),
                                 draft_lens=(0, 4), max_pages_per_req=64)
        t = time.perf_counter()
        runner.capture()
        capture_s = time.perf_counter() - t
        rng = random.Random(0)
        caches = eng.runner.kv_caches
        for case, q_lens in GRAPH_CASES:
            qo, kv, tables, ids, pos, slots = _graph_step(eng, be, q_lens, rng)
            snap = [c.clone() for c in caches]
            want = eng.model(ids, pos, be.build_metadata(qo, kv, tables, slots), caches).clone()
            for c, s in zip(caches, snap):
                c.copy_(s)
            got = runner(ids, pos, be.build_metadata(qo, kv, tables, slots), caches).clone()
            rows.append({"deterministic": det, "case": case, "q_lens": q_lens,
                         "bitwise_equal": bool(torch.equal(got, want)), "capture_s": round(capture_s, 2),
                         "max_abs_diff": (got.float() - want.float()).abs().max().item()})
        del eng, runner
    return {"status": graph_vs_eager_status(rows), "rows": rows}


def section_verify_cost(args) -> dict:
    eng = build_engine(args, args.models[-1], False, max_num_seqs=max(args.verify_batches))
    rows = bench_verify(eng, args.verify_batches, list(range(args.max_k + 1)), args.context,
                        args.iters, 2, seed=0)
    k4 = [r["ratio_to_k0"] for r in rows if r["batch"] == 1 and r["k"] == 4]
    return {"status": "ok", "k4_over_k0_at_b1": k4[0] if k4 else None,
            "goal_met": bool(k4 and k4[0] <= 1.1), "rows": rows}


def section_spec_equiv(args) -> dict:
    rows = []
    for shape in args.models:
        for det in (False, True):
            eng = build_engine(args, shape, det, max_num_seqs=args.batch)
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
            del eng
    ok = all(r["identical"] for r in rows if r["deterministic"])
    return {"status": "ok" if ok else "failed", "rows": rows}


__all__ = ["GRAPH_CASES", "build_engine", "graph_vs_eager_status", "memory_refusal",
           "section_graph_vs_eager", "section_spec_equiv", "section_verify_cost"]
