"""Adaptive draft length vs fixed k (n-gram), CPU, default model, greedy — one run, interleaved.

Configurations (all n-gram prompt lookup, n = 2..4): no speculation, fixed k = 2, 4, 8, and the
adaptive controller (``num_speculative_tokens="auto"``, k chosen per request per step in 0..8
from measured acceptance and the measured step cost c(T); ``spec.adaptive``).

Workloads:

* ``low``: open chat, where prompt lookup rarely pays (Spec-Bench writing, roleplay, humanities,
  qa; first turns), batch 1. Target: adaptive within 3 % of no speculation; fixed k = 8 slower.
* ``high``: copy-heavy prompts (the code-editing set and Spec-Bench summarization), batch 1.
  Target: adaptive within 5 % of the best fixed k.
* ``sweep``: batch sizes ``--batch-sizes`` (default 1 4 16 64) on a mixed list (all 13 Spec-Bench
  categories + code editing, round-robin by category, code editing first). Batch B runs the first
  max(B, 4) prompts of the list, B at a time. Target: adaptive >= the best of no speculation and
  every fixed k at every B, within 5 %.

Method (the machine is shared; see ``benches/common.py``):

* One engine (weights + KV pool) serves all five configurations: each configuration is the
  ``Speculator`` the engine's own builder makes for its ``speculative_config``
  (``engine.builder._build_speculator``: proposer, and for "auto" the start-up step-cost
  measurement and the controller), swapped into the idle engine between runs. n-gram writes no
  draft KV, so the speculator is the only part a ``speculative_config`` changes. One engine
  instead of five keeps memory low (another engineer's benchmarks share the box) and removes
  engine-to-engine differences (weight placement, allocator state) from the ratios.
* Prefix caching is on and each prompt set is prefilled once (untimed, no speculation) before its
  timed runs, so every timed run starts from the same full prefix hit and the timed wall time is
  the generation phase: tokens/s = generated tokens / wall time of the whole run
  (``engine_generate``: add requests, step until done). Decode tokens/s (after every request's
  first token) is reported too.
* Configurations are interleaved prompt by prompt (batch by batch), the order rotating each time,
  for ``--repeats`` passes; the adaptive controller keeps its state across runs, as a serving
  engine would. tok/s of a configuration on a workload = all its tokens / all its time; the
  ratio column is adaptive / that configuration in the same run; ``med ratio`` is the median of
  the per-prompt (per-batch) ratios, which is less sensitive to load drift.
* Every speculative run's tokens are compared with no speculation (greedy must be lossless).

    PYTHONPATH=. python benches/adaptive.py --json /tmp/adaptive.json --markdown --figures
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.adaptive_plots import ADAPTIVE, BASE, figures  # noqa: E402
from benches.common import (  # noqa: E402
    engine_generate,
    machine_info,
    markdown_table,
    median,
    print_table,
    replace_section,
    write_json,
)
from benches.workloads import Prompt, chat_token_ids, code_editing, spec_bench  # noqa: E402

LOW_CATS = ("writing", "roleplay", "humanities", "qa")
MIX_ORDER = ("code_editing", "writing", "summarization", "roleplay", "coding", "humanities",
             "extraction", "qa", "rag", "reasoning", "translation", "math", "stem", "math_reasoning")
HERE = os.path.dirname(os.path.abspath(__file__))


def configs(ks: list[int], max_k: int | None) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {BASE: None}
    for k in ks:
        out[f"k={k}"] = {"method": "ngram", "num_speculative_tokens": k}
    auto = "auto" if max_k is None else max_k
    out[ADAPTIVE] = {"method": "ngram", "num_speculative_tokens": auto, "adaptive": True}
    return out


def mixed_prompts(n: int) -> list[Prompt]:
    per_cat = max(1, -(-n // len(MIX_ORDER)) + 1)
    pools = {c: [] for c in MIX_ORDER}
    for p in spec_bench(per_cat, tuple(c for c in MIX_ORDER if c != "code_editing")):
        pools[p.category].append(p)
    pools["code_editing"] = code_editing()
    out: list[Prompt] = []
    i = 0
    while len(out) < n:
        for c in MIX_ORDER:
            if i < len(pools[c]) and len(out) < n:
                out.append(pools[c][i])
        i += 1
    return out


class Bench:
    """One engine, one ``Speculator`` per configuration, swapped in between runs."""

    def __init__(self, args) -> None:
        from tokenbudget import LLM
        from tokenbudget.api.spec_config import SpeculativeConfig
        from tokenbudget.engine.core.wiring import _build_speculator
        from tokenbudget.spec.speculator import Speculator

        t0 = time.perf_counter()
        self.llm = LLM(num_threads=args.threads, enable_prefix_caching=True,
                       max_model_len=args.max_prompt_tokens + args.max_tokens + 16,
                       kv_cache_memory_bytes=args.kv_mib * 1024 * 1024)
        engine = self.llm.engine
        self.configs = configs(args.ks, args.max_k)
        self.specs = {}
        for label, cfg in self.configs.items():
            t = time.perf_counter()
            self.specs[label] = (Speculator() if cfg is None else
                                 _build_speculator(SpeculativeConfig.from_dict(cfg), engine.target, engine.scheduler,
                                                   engine.runner))
            if label == ADAPTIVE:
                self.startup_cost_s = time.perf_counter() - t
        ctrl = self.specs[ADAPTIVE].controller
        self.startup_cost_model = ctrl.cost_model.points
        print(f"engine + {len(self.specs)} speculators in {time.perf_counter() - t0:.0f}s; "
              f"start-up step-cost measurement {self.startup_cost_s:.1f}s: {ctrl.cost_model}",
              flush=True)
        self.tok = self.llm.tokenizer

    def use(self, label: str):
        engine = self.llm.engine
        assert not engine.has_unfinished_requests()
        engine.core.speculator = self.specs[label]
        return self.specs[label]

    def run(self, label: str, prompts: list[list[int]], max_tokens: int) -> dict:
        spec = self.use(label)
        spec.stats.reset()
        ctrl = spec.controller
        h0 = dict(ctrl.k_histogram) if ctrl is not None else {}
        p0 = ctrl.num_probes if ctrl is not None else 0
        g = engine_generate(self.llm, prompts, max_tokens)
        st = spec.stats
        rec = {"tokens": g.num_tokens, "total_s": g.total_s, "decode_tokens": g.num_tokens - len(prompts),
               "decode_s": g.decode_s, "token_ids": g.token_ids,
               "drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens,
               "accepted": st.num_accepted_tokens, "verified_k": dict(st.k_histogram)}
        if ctrl is not None:
            rec["chosen_k"] = {k: v - h0.get(k, 0) for k, v in ctrl.k_histogram.items()
                               if v - h0.get(k, 0)}
            rec["probes"] = ctrl.num_probes - p0
        return rec

    def prefill(self, prompts: list[list[int]]) -> None:
        """Fill the prefix cache for these prompts (untimed, no speculation)."""
        self.use(BASE)
        for i in range(0, len(prompts), 64):
            engine_generate(self.llm, prompts[i:i + 64], 1)


def run_workload(bench: Bench, name: str, batches: list[list[list[int]]], max_tokens: int,
                 repeats: int, results: dict, tag: str) -> None:
    labels = list(bench.configs)
    bench.prefill([p for b in batches for p in b])
    for rep in range(repeats):
        for j, batch in enumerate(batches):
            shift = (rep * len(batches) + j) % len(labels)
            order = labels[shift:] + labels[:shift]
            recs = {lab: bench.run(lab, batch, max_tokens) for lab in order}
            ref = recs[BASE]["token_ids"]
            for lab in labels:
                r = recs[lab]
                r["lossless"] = r.pop("token_ids") == ref
                r["batch_index"] = j
                results[name][lab].append(r)
            line = "  ".join(f"{lab}={recs[lab]['tokens'] / recs[lab]['total_s']:.1f}" for lab in labels)
            bad = [lab for lab in labels if not recs[lab]["lossless"]]
            print(f"[{tag} rep {rep + 1} batch {j + 1}/{len(batches)} B={len(batch)} "
                  f"tokens={recs[BASE]['tokens']}] {line}" + (f"  LOSSLESS MISMATCH: {bad}" if bad else ""),
                  flush=True)


def summarise(name: str, recs_by_label: dict[str, list[dict]]) -> dict:
    out = {}
    ad = recs_by_label[ADAPTIVE]
    for lab, recs in recs_by_label.items():
        tok = sum(r["tokens"] for r in recs)
        sec = sum(r["total_s"] for r in recs)
        dtok = sum(r["decode_tokens"] for r in recs)
        dsec = sum(r["decode_s"] for r in recs)
        drafts = sum(r["drafts"] for r in recs)
        dt = sum(r["draft_tokens"] for r in recs)
        acc = sum(r["accepted"] for r in recs)
        hist: dict[int, int] = defaultdict(int)
        vhist: dict[int, int] = defaultdict(int)
        for r in recs:
            for k, v in r.get("chosen_k", {}).items():
                hist[int(k)] += v
            for k, v in r["verified_k"].items():
                vhist[int(k)] += v
        per = [a["tokens"] / a["total_s"] / (r["tokens"] / r["total_s"]) for a, r in zip(ad, recs)]
        out[lab] = {"workload": name, "config": lab, "runs": len(recs), "tokens": tok,
                    "tok_s": tok / sec, "decode_tok_s": dtok / dsec if dsec > 0 else float("nan"),
                    "tau": 1 + acc / drafts if drafts else float("nan"),
                    "alpha": acc / dt if dt else float("nan"),
                    "verify_steps": drafts, "draft_tokens": dt,
                    "chosen_k": dict(sorted(hist.items())), "verified_k": dict(sorted(vhist.items())),
                    "probes": sum(r.get("probes", 0) for r in recs),
                    "lossless": all(r["lossless"] for r in recs),
                    "median_adaptive_ratio": median(per)}
    for lab, s in out.items():
        s["adaptive_ratio"] = out[ADAPTIVE]["tok_s"] / s["tok_s"]
        s["adaptive_decode_ratio"] = out[ADAPTIVE]["decode_tok_s"] / s["decode_tok_s"]
    return out


def fmt_hist(h: dict[int, int]) -> str:
    n = sum(h.values())
    if not n:
        return "-"
    return " ".join(f"{k}:{100 * v / n:.0f}%" for k, v in sorted(h.items()) if 100 * v / n >= 0.5)


def verdicts(summ: dict[str, dict], sweep_keys: list[str]) -> list[str]:
    out = []
    if "low" in summ:
        s = summ["low"]
        r0 = s[ADAPTIVE]["tok_s"] / s[BASE]["tok_s"]
        k8 = next((lab for lab in s if lab == "k=8"), None)
        msg = f"(a) low acceptance: adaptive / no-spec = {r0:.3f} (target >= 0.97: {'met' if r0 >= 0.97 else 'MISSED'})"
        if k8:
            r8 = s[k8]["tok_s"] / s[BASE]["tok_s"]
            msg += f"; k=8 / no-spec = {r8:.3f} ({'slower' if r8 < 1 else 'NOT slower'})"
        out.append(msg)
    if "high" in summ:
        s = summ["high"]
        best = max((lab for lab in s if lab.startswith("k=")), key=lambda lab: s[lab]["tok_s"])
        r = s[ADAPTIVE]["tok_s"] / s[best]["tok_s"]
        out.append(f"(b) high acceptance: adaptive / best fixed ({best}) = {r:.3f} "
                   f"(target >= 0.95: {'met' if r >= 0.95 else 'MISSED'})")
    for key in sweep_keys:
        s = summ[key]
        best = max((lab for lab in s if lab != ADAPTIVE), key=lambda lab: s[lab]["tok_s"])
        r = s[ADAPTIVE]["tok_s"] / s[best]["tok_s"]
        out.append(f"(c) {key}: adaptive / best other ({best}) = {r:.3f} "
                   f"(target >= 0.95: {'met' if r >= 0.95 else 'MISSED'})")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--max-k", type=int, default=None, help="adaptive upper bound (default: 'auto' = 8)")
    ap.add_argument("--low-per-category", type=int, default=1)
    ap.add_argument("--code", type=int, default=4, help="code-editing prompts in the high set")
    ap.add_argument("--summarization", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--sweep-max-tokens", type=int, default=48)
    ap.add_argument("--sweep-max-prompt-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the batch-1 sets")
    ap.add_argument("--sweep-repeats", type=int, default=1)
    ap.add_argument("--kv-mib", type=int, default=1024)
    ap.add_argument("--workloads", nargs="+", default=["low", "high", "sweep"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help="write '## Adaptive draft length' into RESULTS.md")
    ap.add_argument("--figures", action="store_true", help="write benches/figures/adaptive_*.png")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    bench = Bench(args)
    tok = bench.tok
    results: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    prompt_info: dict[str, list] = {}

    def ids(ps: list[Prompt], cap: int) -> list[list[int]]:
        return [chat_token_ids(tok, p.text, cap) for p in ps]

    # warm-up: every configuration once (oneDNN primitives, proposer code paths)
    warm = ids(code_editing(1), args.max_prompt_tokens)
    for lab in bench.configs:
        bench.run(lab, warm, 16)

    if "low" in args.workloads:
        ps = spec_bench(args.low_per_category, LOW_CATS)
        prompt_info["low"] = [f"{p.category}/{p.qid}" for p in ps]
        run_workload(bench, "low", [[x] for x in ids(ps, args.max_prompt_tokens)], args.max_tokens,
                     args.repeats, results, "low")
    if "high" in args.workloads:
        ps = code_editing(args.code) + spec_bench(args.summarization, ("summarization",))
        prompt_info["high"] = [f"{p.category}/{p.qid}" for p in ps]
        run_workload(bench, "high", [[x] for x in ids(ps, args.max_prompt_tokens)], args.max_tokens,
                     args.repeats, results, "high")
    sweep_keys = []
    if "sweep" in args.workloads:
        mixed = mixed_prompts(max(max(args.batch_sizes), 4))
        mixed_ids = ids(mixed, args.sweep_max_prompt_tokens)
        prompt_info["sweep"] = [f"{p.category}/{p.qid}" for p in mixed]
        for b in args.batch_sizes:
            n = max(b, 4)
            batches = [mixed_ids[i:i + b] for i in range(0, n, b)]
            key = f"sweep B={b}"
            sweep_keys.append(key)
            run_workload(bench, key, batches, args.sweep_max_tokens, args.sweep_repeats, results, key)

    summ = {name: summarise(name, recs) for name, recs in results.items()}
    ctrl = bench.specs[ADAPTIVE].controller
    result = {"machine": {**machine_info(args.threads), "cpu": _cpu_model(),
                          "loadavg_at_end": os.getloadavg()},
              "args": vars(args), "prompts": prompt_info, "summary": summ,
              "runs": {k: dict(v) for k, v in results.items()},
              "cost_model_startup": bench.startup_cost_model,
              "cost_model_end": ctrl.cost_model.points,
              "cost_model_updates": ctrl.cost_model.num_updates,
              "global_acceptance_end": ctrl.acceptance.global_probs().tolist(),
              "startup_cost_measurement_s": bench.startup_cost_s,
              "wall_s": time.perf_counter() - t_start}
    result["verdicts"] = verdicts(summ, sweep_keys)
    headers, rows = table(summ)
    print()
    print_table(headers, rows)
    print()
    for v in result["verdicts"]:
        print(v)
    print(f"\ncost model at start-up: {_pts(bench.startup_cost_model)}\n"
          f"cost model at the end ({ctrl.cost_model.num_updates} online updates): {_pts(ctrl.cost_model.points)}\n"
          f"total wall time {result['wall_s']:.0f}s")
    result["markdown"] = markdown(args, result, headers, rows)
    write_json(args.json, result)
    if args.figures:
        figures(summ, sweep_keys, os.path.join(HERE, "figures"))
    if args.markdown:
        replace_section(os.path.join(HERE, "RESULTS.md"), "Adaptive draft length", result["markdown"])
    return result


def _pts(points) -> str:
    return ", ".join(f"{t}:{1000 * c:.1f}ms" for t, c in points)


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return "?"


def table(summ: dict) -> tuple[list[str], list[list]]:
    headers = ["workload", "config", "tok/s", "decode tok/s", "adaptive ÷ this", "med ratio",
               "τ", "α", "chosen k (adaptive) / verified k", "lossless"]
    rows = []
    for name, s in summ.items():
        for lab, r in s.items():
            hist = (fmt_hist(r["chosen_k"]) if lab == ADAPTIVE else fmt_hist(r["verified_k"])) if lab != BASE else "-"
            rows.append([name, lab, r["tok_s"], r["decode_tok_s"],
                         "-" if lab == ADAPTIVE else f"{r['adaptive_ratio']:.3f}",
                         "-" if lab == ADAPTIVE else f"{r['median_adaptive_ratio']:.3f}",
                         r["tau"], r["alpha"], hist, "-" if lab == BASE else ("yes" if r["lossless"] else "NO")])
    return headers, rows


def markdown(args, result, headers, rows) -> str:
    m = result["machine"]
    cmd = ("PYTHONPATH=. python benches/adaptive.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("json", "markdown", "figures", "workloads")
        and v is not None) + " --markdown --figures")
    return (
        f"Adaptive draft length (`num_speculative_tokens=\"auto\"`, n-gram, k ∈ 0..{args.max_k or 8} per "
        f"request per step) against fixed k ∈ {{0, {', '.join(map(str, args.ks))}}}, in one run.\n\n"
        f"- Date: 2026-11-21. Machine: `lscpu` model name \"{m['cpu']}\", {m['cpus']} cores shared with "
        f"another engineer's benchmarks (load average {m['loadavg_at_start'][0]:.1f} at the start, "
        f"{m['loadavg_at_end'][0]:.1f} at the end); torch {m['torch']}, {args.threads} thread(s); "
        f"SmolLM2-135M-Instruct fp32, greedy, EOS honoured. Total wall time {result['wall_s'] / 60:.0f} min.\n"
        f"- Command: `{cmd}`\n"
        f"- low = Spec-Bench {', '.join(LOW_CATS)} ({args.low_per_category} per category), high = "
        f"{args.code} code-editing prompts + {args.summarization} Spec-Bench summarization; both batch 1, "
        f"max_tokens {args.max_tokens}, {args.repeats} passes. sweep = mixed list (Spec-Bench round-robin over "
        f"13 categories + code editing), batch B runs the first max(B, 4) prompts B at a time, "
        f"max_tokens {args.sweep_max_tokens}, prompts capped at {args.sweep_max_prompt_tokens} tokens.\n"
        f"- One engine serves all configurations (the engine builder's own `Speculator` per config, swapped "
        f"in between runs; n-gram needs no draft KV). Prefix cache warmed per prompt set, so tok/s = "
        f"generated tokens / wall time of the run = the generation phase end to end. Configurations "
        f"interleaved per prompt/batch in rotating order; 'adaptive ÷ this' = ratio of tok/s in this run, "
        f"'med ratio' = median of per-prompt ratios. Chosen k = the controller's per-request choices "
        f"(adaptive); verified k = draft lengths actually verified (fixed k: n-gram finds no match → 0).\n\n"
        + markdown_table(headers, rows)
        + "\n\nTargets:\n\n" + "\n".join(f"- {v}" for v in result["verdicts"])
        + f"\n\nStep cost c(T) measured at start-up ({result['startup_cost_measurement_s']:.1f} s): "
        f"{_pts(result['cost_model_startup'])}; after {result['cost_model_updates']} online updates: "
        f"{_pts(result['cost_model_end'])}.\n\n"
        "![tokens/s by configuration](figures/adaptive_workloads.png)\n"
        "![batch sweep](figures/adaptive_batch_sweep.png)\n")


if __name__ == "__main__":
    main()
