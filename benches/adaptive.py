"""The draft-length controller's sweep: plain vs fixed k vs ``num_speculative_tokens="auto"``.

Cells: workload (code edit, summaries, QA over a passage, open chat, math) x batch size x torch
threads x kernel path (our C kernels, or torch's with ``TOKENBUDGET_NATIVE=0``). In each cell the
configurations (plain, ngram k = 2, 4, 8, ngram auto) run the same B prompts submitted together
(``LLMEngine.add_request`` then ``step()`` until done), greedy, EOS honoured, prefix caching off
(so every configuration pays the same prefill), one run each (``--repeats R``: R rounds, each
config once per round, the order rotated per round, the median of its rounds), in an order rotated
per cell; below
batch 4 a run is 4 // B such batches of distinct prompts back to back (one prompt is too short a
run to time on a shared machine).
tok/s = generated tokens / wall seconds of the run; "= plain" counts outputs equal to plain's. At
batch 1 the table also gives auto / plain over the decode phase (tokens after each request's
first / the time after it): the issue's "1.4x at batch 1" is a decode speed-up, and with prompts
of 700-1000 tokens and 64 new ones the prefill, which no draft shortens, is a third of the wall
time.

One engine per (threads, kernels) process, one ``Speculator`` per configuration swapped in between
runs (the auto controller's cost model learns across the cells of its process, like a long-running
engine's). Each (threads, kernels) group runs in its own subprocess (the kernel path and the
thread pool are per process).

Prompts (``benches/workloads.py``): code edit = the code-editing set; summaries = Spec-Bench
summarization; QA over a passage = Spec-Bench rag; open chat = Spec-Bench writing + roleplay +
humanities; math = Spec-Bench math + math_reasoning. A batch larger than the set cycles it.

    PYTHONPATH=. python benches/adaptive.py --quick --json benches/results/adaptive.json --markdown --figure
    PYTHONPATH=. python benches/adaptive.py            # full: 5 x {1,4,16,64} x {1,2} x {c,torch}

Goals (issue 28): in every cell auto >= 0.97x the better of plain and the best fixed k, >= 0.99x
plain where nothing pays; at batch 1 on code edits and summaries auto >= 1.4x plain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.common import engine_generate, markdown_table, print_table  # noqa: E402
from benches.workloads import chat_token_ids, code_editing, spec_bench  # noqa: E402

WORKLOADS = {
    "code edit": None,
    "summaries": ("summarization",),
    "QA over a passage": ("rag",),
    "open chat": ("writing", "roleplay", "humanities"),
    "math": ("math", "math_reasoning"),
}
SHORT = {"code edit": "code", "summaries": "summaries", "QA over a passage": "qa", "open chat": "chat",
         "math": "math"}
PLAIN, AUTO = "plain", "auto"


def configs(ks: list[int], method: str) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {PLAIN: None}
    for k in ks:
        out[f"k={k}"] = {"method": method, "num_speculative_tokens": k}
    out[AUTO] = {"method": method, "num_speculative_tokens": "auto"}
    return out


def prompt_texts(workload: str, n: int) -> list[str]:
    cats = WORKLOADS[workload]
    if cats is None:
        ps = code_editing(12)
    else:
        ps = spec_bench(10, cats)
    texts = [p.text for p in ps]
    return [texts[i % len(texts)] for i in range(n)]


# ------------------------------------------------------------------------------ one process
def worker(args) -> dict:
    import torch

    from tokenbudget import LLM
    from tokenbudget.api.spec_config import SpeculativeConfig
    from tokenbudget.engine.drafters.factory import build_speculator
    from tokenbudget.spec.speculator import Speculator

    llm = LLM(num_threads=args.threads, enable_prefix_caching=False,
              max_model_len=args.max_prompt_tokens + args.max_tokens + 16,
              max_num_seqs=max(args.batch_sizes))
    engine = llm.engine
    cfgs = configs(args.ks, args.method)
    t0 = time.perf_counter()
    specs = {label: (Speculator() if cfg is None else build_speculator(
        SpeculativeConfig.from_dict(cfg), engine.target, engine.scheduler, engine.runner))
        for label, cfg in cfgs.items()}
    ctrl = specs[AUTO].controller
    print(f"[{args.kernels}, {args.threads} thr] speculators built in {time.perf_counter() - t0:.1f}s; "
          f"prior: {ctrl.cost_model}", flush=True)
    native = getattr(engine.runner.model, "cpu_forward", None) is not None
    tok = llm.tokenizer
    cells = []
    rot = 0
    for workload in args.workloads:
        for b in args.batch_sizes:
            # batches below 4 run 4 // B batches of distinct prompts back to back: a one-prompt,
            # sub-second run is too short to time on a shared machine
            groups = max(1, 4 // b)
            ids = [chat_token_ids(tok, t, args.max_prompt_tokens) for t in prompt_texts(workload, b * groups)]
            labels = list(cfgs)
            order = labels[rot % len(labels):] + labels[:rot % len(labels)]
            rot += 1
            load0 = os.getloadavg()[0]
            runs = {}
            for rep in range(args.repeats):  # round robin: every config once per round, order rotated
                for label in order[rep % len(order):] + order[:rep % len(order)]:
                    engine.core.speculator = specs[label]
                    specs[label].stats.reset()
                    h0 = dict(ctrl.k_histogram)
                    gs = [engine_generate(llm, ids[i:i + b], args.max_tokens) for i in range(0, len(ids), b)]
                    st = specs[label].stats
                    n, sec = sum(g.num_tokens for g in gs), sum(g.total_s for g in gs)
                    dec_n = sum(g.num_tokens - len(g.token_ids) for g in gs)
                    dec_s = sum(g.decode_s for g in gs)
                    r = runs.setdefault(label, {"tok_s_runs": [], "decode_tok_s_runs": [], "draft_tokens": 0,
                                                "accepted": 0, "token_ids_runs": []})
                    r["tok_s_runs"].append(n / sec)
                    r["decode_tok_s_runs"].append(dec_n / dec_s if dec_s > 0 else float("nan"))
                    r["token_ids_runs"].append([t for g in gs for t in g.token_ids])
                    r["draft_tokens"] += st.num_draft_tokens
                    r["accepted"] += st.num_accepted_tokens
                    if label == AUTO:
                        ks = r.setdefault("chosen_k", {})
                        for k, v in ctrl.k_histogram.items():
                            if v - h0.get(k, 0):
                                ks[int(k)] = ks.get(int(k), 0) + v - h0.get(k, 0)
            for r in runs.values():  # a config's figure: the median of its rounds
                r["tok_s"] = statistics.median(r["tok_s_runs"])
                r["decode_tok_s"] = statistics.median(r["decode_tok_s_runs"])
                r["token_ids"] = r.pop("token_ids_runs")
            plain_ids = runs[PLAIN].pop("token_ids")[0]
            for label, r in runs.items():
                if label != PLAIN:  # equal on every round
                    rounds = r.pop("token_ids")
                    r["equal_plain"] = min(sum(a == p for a, p in zip(ids_l, plain_ids)) for ids_l in rounds)
            cell = {"workload": workload, "batch": b, "batches": groups, "threads": args.threads,
                    "kernels": args.kernels, "native_forward": native, "load_start": load0,
                    "load_end": os.getloadavg()[0], "prompt_tokens": sum(len(i) for i in ids), "runs": runs}
            cells.append(cell)
            print(" ".join([f"{SHORT[workload]:>9} B={b:<3}"] + [f"{lab}={runs[lab]['tok_s']:7.1f}" for lab in cfgs]
                           + [f"auto/best={_ratio(cell):.3f} load={load0:.1f} auto k: {runs[AUTO].get('chosen_k')}"]),
                  flush=True)
    print(f"[{args.kernels}, {args.threads} thr] cost model at the end: {ctrl.cost_model}", flush=True)
    return {"cells": cells, "cost_model_end": ctrl.cost_model.coefficients(),
            "cost_model_prior": dict(zip(ctrl.cost_model.coefficients(), ctrl.cost_model.prior_weights.tolist())),
            "cost_model_updates": ctrl.cost_model.num_updates, "torch": torch.__version__}


def _best_other(cell: dict) -> tuple[str, float]:
    others = {k: v["tok_s"] for k, v in cell["runs"].items() if k != AUTO}
    best = max(others, key=others.get)
    return best, others[best]


def _ratio(cell: dict) -> float:
    return cell["runs"][AUTO]["tok_s"] / _best_other(cell)[1]


# ------------------------------------------------------------------------------ the sweep
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="subset: batch 1/4/16, 1 thread, C kernels, 64 new tokens (~15 min on 2 cores)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--threads", type=int, nargs="+", default=None)
    ap.add_argument("--kernels", nargs="+", default=None, choices=["c", "torch"])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds per cell (every config once per round, order rotated); tok/s = the median")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help="write the section into benches/RESULTS.md")
    ap.add_argument("--figure", action="store_true", help="write benches/figures/adaptive_sweep.png")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.threads, args.kernels = args.threads[0], args.kernels[0]
        res = worker(args)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return res
    args.batch_sizes = args.batch_sizes or ([1, 4, 16] if args.quick else [1, 4, 16, 64])
    args.threads = args.threads or ([1] if args.quick else [1, 2])
    args.kernels = args.kernels or (["c"] if args.quick else ["c", "torch"])
    args.max_tokens = args.max_tokens or (64 if args.quick else 96)
    t0 = time.perf_counter()
    groups = []
    for kernels in args.kernels:
        for threads in args.threads:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = tmp.name
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--threads", str(threads),
                   "--kernels", kernels, "--out", out, "--max-tokens", str(args.max_tokens),
                   "--max-prompt-tokens", str(args.max_prompt_tokens), "--method", args.method,
                   "--repeats", str(args.repeats),
                   "--workloads", *args.workloads, "--batch-sizes", *map(str, args.batch_sizes),
                   "--ks", *map(str, args.ks)]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENBUDGET_NATIVE="0" if kernels == "torch" else "1")
            subprocess.run(cmd, env=env, check=True)
            with open(out) as f:
                groups.append(json.load(f))
            os.unlink(out)
    cells = [c for g in groups for c in g["cells"]]
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": _cpu(), "argv": sys.argv[1:], "cells": cells,
              "groups": [{k: v for k, v in g.items() if k != "cells"} for g in groups],
              "wall_s": time.perf_counter() - t0}
    headers, rows = table(cells, list(configs(args.ks, args.method)))
    print_table(headers, rows)
    for line in verdicts(cells):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.figure:
        figure(cells, os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures", "adaptive_sweep.png"))
    if args.markdown:
        print(markdown_table(headers, rows))
    return result


def table(cells: list[dict], labels: list[str]) -> tuple[list[str], list[list]]:
    headers = ["kernels", "threads", "workload", "B"] + [f"{lab} tok/s" for lab in labels] + [
        "auto ÷ plain", "auto ÷ best other", "auto ÷ plain, decode phase", "= plain", "load"]
    rows = []
    for c in cells:
        r = c["runs"]
        n = c["batch"] * c.get("batches", 1)
        eq = min(v.get("equal_plain", n) for v in r.values())
        best, _ = _best_other(c)
        rows.append([c["kernels"], c["threads"], c["workload"], c["batch"]]
                    + [f"{r[lab]['tok_s']:.1f}" for lab in labels]
                    + [f"{r[AUTO]['tok_s'] / r[PLAIN]['tok_s']:.2f}", f"{_ratio(c):.3f} ({best})",
                       _decode_ratio(c), f"{eq}/{n}", f"{c['load_start']:.1f}-{c['load_end']:.1f}"])
    return headers, rows


def _decode_ratio(cell: dict) -> str:
    """auto / plain over the decode phase (after each request's first token: no prefill), batch 1
    only: with B requests in one step, whose prefill overlaps whose decode is not separable."""
    r = cell["runs"]
    if cell["batch"] != 1 or "decode_tok_s" not in r[AUTO]:
        return "-"
    return f"{r[AUTO]['decode_tok_s'] / r[PLAIN]['decode_tok_s']:.2f}"


def verdicts(cells: list[dict]) -> list[str]:
    """The issue's goals, cell by cell."""
    out, misses = [], []
    for c in cells:
        r = c["runs"]
        plain = r[PLAIN]["tok_s"]
        best_label, best = _best_other(c)
        ratio = r[AUTO]["tok_s"] / best
        name = f"{c['kernels']}/{c['threads']}t/{SHORT[c['workload']]}/B={c['batch']}"
        if best_label == PLAIN and r[AUTO]["tok_s"] / plain < 0.99:
            misses.append(f"{name}: auto/plain {r[AUTO]['tok_s'] / plain:.3f} < 0.99 (nothing pays)")
        elif ratio < 0.97:
            misses.append(f"{name}: auto/{best_label} {ratio:.3f} < 0.97")
        if c["batch"] == 1 and c["workload"] in ("code edit", "summaries"):
            dec = r[AUTO]["decode_tok_s"] / r[PLAIN]["decode_tok_s"]
            if dec < 1.4:
                misses.append(f"{name}: auto/plain {r[AUTO]['tok_s'] / plain:.2f} wall, {dec:.2f} decode phase < 1.4")
    out.append(f"cells: {len(cells)}; goal misses: {len(misses)}")
    out += ["  MISSED " + m for m in misses]
    return out


def figure(cells: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(c["kernels"], c["threads"]) for c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (kern, thr) in zip(axes[0], groups):
        for w in WORKLOADS:
            cs = sorted((c for c in cells if c["kernels"] == kern and c["threads"] == thr and c["workload"] == w),
                        key=lambda c: c["batch"])
            if cs:
                ax.plot([c["batch"] for c in cs], [_ratio(c) for c in cs], marker="o", label=w)
        ax.axhline(0.97, color="grey", ls="--", lw=1)
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("auto tok/s ÷ best of plain and fixed k")
        ax.set_title(f"{kern} kernels, {thr} thread(s)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
