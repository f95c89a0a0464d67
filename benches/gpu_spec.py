"""Speculative decoding on a GPU with random-weight Llama models (no model files needed).

Built for an offline H100/H200 session (the default model's GGUF cannot travel there): the
models are random-weight Llamas of realistic shapes generated on the device
(``benches/synthetic_model.py``: ``1b`` = Llama-3.2-1B-like, ``8b`` = Llama-3-8B-like), and the
drafter is an oracle that proposes the target's own greedy continuation (recorded by the
no-speculation run), each token right with probability α. Three measurements:

(a) verify cost: one ``ModelRunner.execute`` over B requests each with 1 + k tokens (k drafts) at
    ``--context`` tokens already in the KV cache, k = 0..8, B in ``--verify-batches``; median ms and
    the ratio to k = 0 (what speculation rests on: a k-draft verify costs about one decode).
    Hand-built ``SchedulerOutput`` s; KV pages hold zeros (attention cost does not depend on values);
    drafts are random (mostly rejected: the sampler's verify work is included).
(b) decode tokens/s at ``--decode-batches`` (default 1 and 64): no speculation vs the oracle at
    k in ``--spec-ks`` and α in ``--alphas``; greedy, ignore_eos, same prompts. Decode tokens/s =
    (generated - B) / (time from the step where every request has its first token to the last
    step). ``lossless`` = every request's tokens equal the no-speculation tokens; ``match`` = the
    share of tokens up to each request's first divergence. NOTE on GPU: the torch/cuBLAS/FlashInfer
    path is not guaranteed batch-invariant (a position's logits may differ by a few bits between a
    1-row decode and a (1 + k)-row verify), so with a random model (near-tied logits) "no" there can
    be numerics rather than a bug; after a divergence the oracle's references are stale and its
    acceptance drops.
(c) time per decode step split into scheduler (``schedule``), input preparation (``_prepare``),
    forward, logits (lm head), sampling/verify (``sampler``), ``plan_update``/``apply_update``,
    speculator (``propose``/``commit``: drafting) and the rest, from separate profiled runs with
    ``torch.cuda.synchronize()`` around every GPU part (so the split adds sync overhead; use (b)
    for throughput).

    PYTHONPATH=. python benches/gpu_spec.py --device cuda --shape 1b --dtype bfloat16 \
        --json benches/results/gpu_spec_1b.json --markdown

CPU smoke (seconds): ``--device cpu --shape tiny --dtype float32`` with small sizes (see
``tests/test_gpu_bench_smoke.py``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tokenbudget.api.sampling_params import SamplingParams  # noqa: E402
from tokenbudget.scheduler.output import ScheduledRequest, SchedulerOutput  # noqa: E402

from benches.common import machine_info, replace_section, write_json  # noqa: E402
from benches.gpu_row_check import RowCheck  # noqa: E402
from benches.gpu_spec_report import SPLIT_KEYS, markdown_body, print_report  # noqa: E402
from benches.step_timer import StepTimer, sync  # noqa: E402
from benches.synthetic_model import (  # noqa: E402
    SHAPES,
    OracleProposer,
    apply_engine_modes,
    build_synthetic_engine,
    param_count,
)

SECTION = "GPU speculation (synthetic models)"
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


# ------------------------------------------------------------------------------ (a) verify cost
def _verify_batch(eng, batch: int, k: int, context: int, rng: random.Random) -> SchedulerOutput | None:
    """B requests, each with ``context`` tokens in the cache and 1 + k scheduled (k drafts)."""
    bs = eng.runner.block_size
    nb = -(-(context + 1 + k) // bs)
    if batch * nb > eng.scheduler.config.num_blocks or context + 1 + k > eng.scheduler.config.max_model_len:
        return None
    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    sched = SchedulerOutput()
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(context + 1)]
        drafts = [rng.randrange(vocab) for _ in range(k)]
        sched.scheduled.append(ScheduledRequest(
            request_id=f"verify-{i}", num_computed_tokens=context, token_ids=[prompt[-1]] + drafts,
            spec_token_ids=drafts, block_ids=list(range(i * nb, (i + 1) * nb)), is_new=False, needs_sample=True,
            params=params))
    sched.total_num_scheduled_tokens = batch * (1 + k)
    return sched


def bench_verify(eng, batches: list[int], ks: list[int], context: int, iters: int, warmup: int,
                 seed: int) -> list[dict]:
    rng = random.Random(seed)
    dev = eng.device
    rows = []
    for b in batches:
        base = None
        for k in ks:
            sched = _verify_batch(eng, b, k, context, rng)
            if sched is None:
                print(f"  verify: B={b} k={k} does not fit the KV pool, skipped", flush=True)
                continue
            times = []
            try:
                for _ in range(warmup):
                    eng.runner.execute(sched)
                for _ in range(iters):
                    sync(dev)
                    t = time.perf_counter()
                    eng.runner.execute(sched)  # synchronizes on CUDA before returning
                    sync(dev)
                    times.append(time.perf_counter() - t)
            except torch.OutOfMemoryError:
                print(f"  verify: B={b} k={k} ran out of device memory, skipped", flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            ms = statistics.median(times) * 1e3
            if k == 0:
                base = ms
            rows.append({"batch": b, "k": k, "tokens": b * (1 + k), "context": context, "ms": ms,
                         "min_ms": min(times) * 1e3,
                         "ratio_to_k0": ms / base if base else float("nan")})
            print(f"  verify B={b:4d} k={k}: {ms:8.3f} ms  x{rows[-1]['ratio_to_k0']:.3f}", flush=True)
    return rows


# ------------------------------------------------------------------------------ (b) decode
def run_generation(eng, prompts: list[list[int]], max_tokens: int, timer: StepTimer | None = None):
    """Greedy, ignore_eos. Returns (tokens per request, decode seconds, decode tokens, steps,
    per-step split dicts of the decode steps)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    t_first = None
    steps = 0
    splits = []
    while eng.has_unfinished_requests():
        if timer is not None:
            timer.cur = defaultdict(float)
        sync(eng.device)
        t = time.perf_counter()
        outs = eng.step()
        sync(eng.device)
        now = time.perf_counter()
        for o in outs:
            toks[o.request_id].extend(o.outputs[0].token_ids)
        if t_first is not None:
            steps += 1
            if timer is not None:
                d = dict(timer.cur)
                d["other"] = max(0.0, (now - t) - sum(d.values()))
                d["total"] = now - t
                splits.append(d)
        if t_first is None and all(toks.values()):
            t_first = now
    t_end = time.perf_counter()
    n = sum(len(v) for v in toks.values()) - len(ids)
    return [toks[rid] for rid in ids], (t_end - t_first) if t_first else float("nan"), n, steps, splits


def _match(out: list[list[int]], ref: list[list[int]]) -> float:
    same = total = 0
    for o, r in zip(out, ref):
        total += len(r)
        for a, b in zip(o, r):
            if a != b:
                break
            same += 1
    return same / total if total else float("nan")


def _divergences(out: list[list[int]], ref: list[list[int]]) -> list[tuple[int, int]]:
    """(request, first differing output index) for every request that differs (for diagnosis)."""
    bad = []
    for i, (o, r) in enumerate(zip(out, ref)):
        j = next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), None)
        if j is None and len(o) != len(r):
            j = min(len(o), len(r))
        if j is not None:
            bad.append((i, j))
    return bad


def _set_spec(eng, k: int, alpha: float, refs: dict[str, list[int]], seed: int) -> None:
    if k == 0:
        eng.set_speculator(None)
    else:
        eng.set_speculator(OracleProposer(alpha, eng.model_config.vocab_size, refs, seed=seed), k)


def bench_decode(eng, batches: list[int], prompt_len: int, max_tokens: int, spec_ks: list[int],
                 alphas: list[float], repeats: int, seed: int, profile: bool):
    rng = random.Random(seed + 1)
    vocab = eng.model_config.vocab_size
    rows, split_rows = [], []
    # Warm-up (CUDA kernels / FlashInfer JIT / allocator): a short run per batch size, both paths.
    for b in batches:
        wp = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(b)]
        eng.set_speculator(None)
        run_generation(eng, wp, 4)
        if spec_ks:
            _set_spec(eng, max(spec_ks), 1.0, {}, seed)
            run_generation(eng, wp, 4)
    for b in batches:
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(b)]
        configs = [(0, 1.0)] + [(k, a) for k in spec_ks for a in alphas]
        ref = None
        ref_map: dict[str, list[int]] = {}
        results = {c: [] for c in configs}
        outs_by_cfg = {}
        stats_by_cfg = {}
        for rep in range(repeats):
            for k, a in configs:  # interleaved: the no-spec reference first in every repeat
                if k and ref is None:
                    continue
                _set_spec(eng, k, a, ref_map, seed + rep)
                out, dt, n, steps, _ = run_generation(eng, prompts, max_tokens)
                if k == 0 and ref is None:
                    ref = out
                    ref_map = {f"r{i}": t for i, t in enumerate(ref)}
                results[(k, a)].append((n / dt if dt > 0 else float("nan"), steps, dt))
                outs_by_cfg[(k, a)] = out
                if k:
                    stats_by_cfg[(k, a)] = eng.speculator.stats
        base_tps = statistics.median(r[0] for r in results[(0, 1.0)])
        for k, a in configs:
            res = results[(k, a)]
            tps = statistics.median(r[0] for r in res)
            steps = statistics.median(r[1] for r in res)
            st = stats_by_cfg.get((k, a))
            row = {"batch": b, "k": k, "alpha": a if k else None, "decode_tok_s": tps,
                   "speedup": tps / base_tps if base_tps else float("nan"),
                   "decode_steps": steps, "ms_per_step": statistics.median(r[2] / max(r[1], 1) for r in res) * 1e3,
                   "lossless": outs_by_cfg[(k, a)] == ref, "match": _match(outs_by_cfg[(k, a)], ref),
                   "first_divergence": _divergences(outs_by_cfg[(k, a)], ref)}
            if st is not None and st.num_drafts:
                row["tau"] = 1 + st.num_accepted_tokens / st.num_drafts
                row["acceptance"] = st.num_accepted_tokens / max(st.num_draft_tokens, 1)
            rows.append(row)
            print(f"  decode B={b} k={k} a={a if k else '-'}: {tps:9.1f} tok/s  x{row['speedup']:.2f}  "
                  f"lossless={row['lossless']}", flush=True)
        if profile:
            prof_cfgs = [(0, 1.0)] + ([(max(spec_ks), max(alphas))] if spec_ks and alphas else [])
            for k, a in prof_cfgs:
                _set_spec(eng, k, a, ref_map, seed) if k else eng.set_speculator(None)
                with StepTimer(eng) as timer:
                    _, _, _, steps, splits = run_generation(eng, prompts, max_tokens, timer)
                if not splits:
                    continue
                mean = {key: statistics.fmean(s.get(key, 0.0) for s in splits) * 1e3
                        for key in SPLIT_KEYS + ("total",)}
                split_rows.append({"batch": b, "k": k, "alpha": a if k else None, "steps": len(splits),
                                   "ms": mean,
                                   "share": {key: mean[key] / mean["total"] if mean["total"] else float("nan")
                                             for key in SPLIT_KEYS}})
                print(f"  split B={b} k={k}: " + " ".join(f"{key}={mean[key]:.3f}" for key in SPLIT_KEYS)
                      + f" total={mean['total']:.3f} ms", flush=True)
    eng.set_speculator(None)
    return rows, split_rows


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--kv-gb", type=float, default=0.0,
                    help="KV pool GiB (0 = --kv-fraction of free device memory after the weights on "
                         "cuda, 0.0625 GiB on cpu)")
    ap.add_argument("--kv-fraction", type=float, default=0.6)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0 = enough for one prefill of all prompts")
    ap.add_argument("--verify-batches", default="1,8,32,128")
    ap.add_argument("--verify-ks", default="0,1,2,3,4,5,6,7,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--verify-iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--decode-batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec-ks", default="2,4")
    ap.add_argument("--alphas", default="0.6,0.9")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-profile", action="store_true", help="skip (c), the per-step split")
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch_ref"],
                    help="torch_ref forces the reference attention (sets TOKENBUDGET_ATTENTION_BACKEND)")
    ap.add_argument("--deterministic", action="store_true",
                    help="EngineConfig(deterministic=True)'s transformations: batch-invariant GEMMs and one "
                         "attention tile for every decode/verify")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay captured CUDA graphs for decode/verify steps (EngineConfig(cuda_graphs=True)); "
                         "buckets k = 0 and max(--spec-ks)")
    ap.add_argument("--check-rows", action="store_true",
                    help="compare every verify row with a decode of its position, in the engine's own steps "
                         "(benches/gpu_row_check.py; eager only)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help=f"write the '## {SECTION}' section of --results-md")
    ap.add_argument("--results-md", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    ap.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                    help="run nothing: print the tables of saved --json files (and --markdown them, "
                         "one subsection each)")
    args = ap.parse_args(argv)
    if args.check_rows and args.cuda_graphs:
        ap.error("--check-rows: eager steps only (a hooked attend is not captured in a graph)")
    if args.from_json:
        import json
        results = [json.load(open(p)) for p in args.from_json]
        for r in results:
            print(f"\n== {r['info']['shape']} on {r['info']['device']}")
            print_report(r)
        if args.markdown:
            replace_section(args.results_md, SECTION, markdown_body(results))
        return {"results": results}

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.attention == "torch_ref":
        os.environ["TOKENBUDGET_ATTENTION_BACKEND"] = "torch_ref"
    cfg = SHAPES[args.shape]
    verify_batches, verify_ks = _ints(args.verify_batches), _ints(args.verify_ks)
    decode_batches = _ints(args.decode_batches)
    spec_ks, alphas = _ints(args.spec_ks), _floats(args.alphas)
    max_seqs = max(verify_batches + decode_batches + [1])
    mnbt = args.max_num_batched_tokens or max(2048, max(decode_batches + [1]) * args.prompt_len)

    t0 = time.perf_counter()
    if args.kv_gb > 0:
        kv_bytes = int(args.kv_gb * (1 << 30))
    elif device.type == "cuda":
        weights = param_count(cfg) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        free = torch.cuda.mem_get_info(device)[0]
        kv_bytes = int((free - weights) * args.kv_fraction)
    else:
        kv_bytes = 1 << 26
    eng = build_synthetic_engine(args.shape, device, dtype, kv_bytes=kv_bytes, max_num_seqs=max_seqs,
                                 max_num_batched_tokens=mnbt, block_size=args.block_size, seed=args.seed)
    apply_engine_modes(eng, deterministic=args.deterministic, cuda_graphs=args.cuda_graphs,
                       max_spec_tokens=max(spec_ks + [0]))
    sync(device)
    build_s = time.perf_counter() - t0
    row_check = RowCheck(eng.runner.attn_backend, cfg.num_hidden_layers) if args.check_rows else None
    info = {"shape": args.shape, "params_b": param_count(cfg) / 1e9, "device": _device_name(device),
            "dtype": dtype, "attention_backend": eng.runner.attn_backend.name,
            "kv_blocks": eng.scheduler.config.num_blocks, "kv_gib": kv_bytes / (1 << 30),
            "block_size": args.block_size, "build_s": build_s,
            "deterministic": args.deterministic, "cuda_graphs": args.cuda_graphs, "args": vars(args),
            "machine": machine_info(torch.get_num_threads()),
            "date": time.strftime("%Y-%m-%d")}
    print(f"{args.shape}: {info['params_b']:.2f}B params on {info['device']} ({dtype}), attention "
          f"{info['attention_backend']}, deterministic={args.deterministic}, cuda_graphs={args.cuda_graphs}, "
          f"{info['kv_blocks']} KV blocks ({info['kv_gib']:.1f} GiB), "
          f"built in {build_s:.1f}s", flush=True)

    result = {"info": info, "verify_cost": [], "decode": [], "step_split": []}
    if not args.skip_verify:
        print("(a) verify cost", flush=True)
        result["verify_cost"] = bench_verify(eng, verify_batches, verify_ks, args.context,
                                             args.verify_iters, args.warmup, args.seed)
        write_json(args.json, result)  # partial results survive a later failure
    if not args.skip_decode:
        print("(b) decode / (c) step split", flush=True)
        result["decode"], result["step_split"] = bench_decode(
            eng, decode_batches, args.prompt_len, args.max_tokens, spec_ks, alphas, args.repeats,
            args.seed, not args.no_profile)

    if row_check is not None:
        result["row_check"] = row_check.report()
    info["command"] = "python benches/gpu_spec.py " + " ".join(argv if argv is not None else sys.argv[1:])
    info["torch"] = torch.__version__
    print_report(result)
    write_json(args.json, result)
    if args.markdown:
        replace_section(args.results_md, SECTION, markdown_body([result]))
    return result


if __name__ == "__main__":
    main()
