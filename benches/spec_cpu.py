"""Speculative decoding on CPU, Spec-Bench protocol: default model, greedy, batch 1, per category.

For every prompt (Spec-Bench first turns per category + the code-editing set), in one process
and interleaved prompt by prompt, this runs:

* tokenbudget without speculation (the baseline, and the reference tokens),
* tokenbudget with each method in ``--methods`` (``ngram:K``, ``suffix``, ``suffix:K``,
  ``self_draft:LAYERS:K``, ``eagle3:K`` (the shipped head; ``eagle3:K:DIR`` another),
  ``eagle3+suffix:K`` (the head plus suffix drafts where text repeats); K may be
  ``auto``: the adaptive controller chooses the draft length per request and step, and may
  turn speculation off where it does not pay),
* transformers ``generate(prompt_lookup_num_tokens=K, do_sample=False)`` on the same weights
  (fp32), same prompt ids, same ``max_new_tokens``, same threads.

and reports, per category and method: τ (tokens per verify step incl. the bonus), α by draft
position, decode tokens/s (first generated token to last; prefill excluded since every method
prefills identically), speedup over no speculation, speedup over transformers' prompt lookup,
and ``lossless``: whether every prompt's tokens equal the no-speculation tokens exactly (any
"no" is a bug; the mismatching prompts are printed and stored in the JSON).

It also profiles every tokenbudget step (``benches.common.StepProfiler``): the share of step
time in the model forward, lm head, sampler/verify, input prep, scheduler, output processing,
proposer and the rest.

    PYTHONPATH=. python benches/spec_cpu.py --per-category 1 --max-new-tokens 128 \
        --json benches/results/spec_cpu.json --markdown --figures

``--kernels torch`` runs the model's linears unquantized on torch's kernels (fp32) instead of the
default model's int4 weights on the C kernels (and the C decoder forward); ``--section`` and
``--figure-prefix`` keep such runs beside the default one in RESULTS.md and figures/.

Prompts are capped at ``--max-prompt-tokens`` (default 1500) tokens (the user message is cut).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benches.common import (  # noqa: E402
    GenTiming,
    StepProfile,
    StepProfiler,
    engine_generate,
    hf_generate,
    load_hf_model,
    machine_info,
    markdown_table,
    median,
    print_table,
    replace_section,
    write_json,
)
from benches.workloads import bench_prompts, chat_token_ids  # noqa: E402

BASE = "no-spec"
HF_PLD = "hf-pld"


def _k(s: str):
    return "auto" if s == "auto" else int(s)


def parse_method(s: str) -> tuple[str, dict]:
    parts = s.split(":")
    m = parts[0]
    if m == "ngram":
        k = _k(parts[1]) if len(parts) > 1 else 4
        return f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k}
    if m == "suffix":
        cfg = {"method": "suffix"}
        if len(parts) > 1:
            cfg["num_speculative_tokens"] = _k(parts[1])
        return ("suffix" + (f" k={parts[1]}" if len(parts) > 1 else "")), cfg
    if m == "self_draft":
        layers = int(parts[1]) if len(parts) > 1 else 8
        k = _k(parts[2]) if len(parts) > 2 else 2
        return f"self_draft L={layers} k={k}", {"method": "self_draft", "draft_num_layers": layers,
                                                "num_speculative_tokens": k}
    if m in ("eagle3", "eagle3+suffix"):
        k = _k(parts[1]) if len(parts) > 1 else 4
        cfg = {"method": "eagle3", "num_speculative_tokens": k}
        if m == "eagle3+suffix":
            cfg["enable_suffix_decoding"] = True
        label = f"{m} k={k}"
        if len(parts) > 2:
            cfg["model"] = ":".join(parts[2:])
            label += f" ({os.path.basename(os.path.normpath(cfg['model']))})"  # two heads side by side
        return label, cfg
    raise SystemExit(f"unknown method {s!r}: use ngram:K, suffix[:K], self_draft:LAYERS:K, eagle3[+suffix][:K[:DIR]] "
                     "(K may be 'auto')")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--categories", nargs="*", default=None, help="default: all 13 + code_editing")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1500)
    ap.add_argument("--methods", nargs="+", default=["ngram:2", "ngram:4", "ngram:8", "suffix", "self_draft:8:2"])
    ap.add_argument("--hf-pld-k", type=int, default=4, help="transformers prompt_lookup_num_tokens")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help="write '## Speculative decoding on CPU' into RESULTS.md")
    ap.add_argument("--figures", action="store_true", help="write PNGs into benches/figures/")
    ap.add_argument("--kernels", choices=["c", "torch"], default="c",
                    help="c: the default model's int4 weights on the C kernels; torch: fp32 on torch's kernels")
    ap.add_argument("--section", default="Speculative decoding on CPU", help="the RESULTS.md section to write")
    ap.add_argument("--figure-prefix", default="spec", help="figures/<prefix>_*.png")
    args = ap.parse_args(argv)

    from tokenbudget import LLM
    from tokenbudget.spec.metrics import SpecDecodingStats

    torch.set_num_threads(args.threads)
    common = dict(num_threads=args.threads, max_model_len=args.max_prompt_tokens + args.max_new_tokens + 64,
                  kv_cache_memory_bytes=256 * 1024 * 1024, enable_prefix_caching=False,
                  quantization="none" if args.kernels == "torch" else "auto")
    methods = [parse_method(s) for s in args.methods]
    t_load = time.perf_counter()
    llms = {BASE: LLM(**common)}
    for label, cfg in methods:
        llms[label] = LLM(speculative_config=cfg, **common)
    hf = None
    tok = llms[BASE].tokenizer
    if not args.no_hf:
        hf, _ = load_hf_model(args.threads)
    print(f"loaded {len(llms)} engines{' + transformers' if hf is not None else ''} "
          f"in {time.perf_counter() - t_load:.0f}s", flush=True)
    eos = llms[BASE].engine.model_config.eos_token_ids
    labels = [BASE] + [m[0] for m in methods] + ([HF_PLD] if hf is not None else [])

    prompts = bench_prompts(args.per_category, tuple(args.categories) if args.categories else None)
    ids = [chat_token_ids(tok, p.text, args.max_prompt_tokens) for p in prompts]

    def run(label: str, p_ids: list[int], max_tokens: int) -> GenTiming:
        if label == HF_PLD:
            return hf_generate(hf, [p_ids], max_tokens, pad_id=eos[0], eos_ids=eos,
                               prompt_lookup_num_tokens=args.hf_pld_k)
        return engine_generate(llms[label], [p_ids], max_tokens)

    # Warm-up (oneDNN primitives, allocator, proposer code paths) on a prompt outside the set: a
    # measured prompt would leave its output in suffix decoding's global cache.
    warm = chat_token_ids(tok, "Name three colours.", args.max_prompt_tokens)
    for label in labels:
        run(label, warm, 16)

    timings: dict[str, dict[str, list[GenTiming]]] = defaultdict(lambda: defaultdict(list))
    stats: dict[str, dict[str, SpecDecodingStats]] = defaultdict(lambda: defaultdict(SpecDecodingStats))
    profiles = {label: StepProfile() for label in labels if label != HF_PLD}
    mismatches: list[dict] = []
    t_start = time.perf_counter()
    for i, (p, p_ids) in enumerate(zip(prompts, ids)):
        ref = None
        for label in labels:
            if label in llms:
                llm = llms[label]
                if llm.get_spec_stats() is not None:
                    llm.get_spec_stats().reset()
                with StepProfiler(llm) as prof:
                    g = run(label, p_ids, args.max_new_tokens)
                _merge_profile(profiles[label], prof)
                if llm.get_spec_stats() is not None:
                    stats[p.category][label].merge(llm.get_spec_stats())
            else:
                g = run(label, p_ids, args.max_new_tokens)
            timings[p.category][label].append(g)
            if label == BASE:
                ref = g.token_ids[0]
            elif g.token_ids[0] != ref:
                n_same = next((j for j, (a, b) in enumerate(zip(ref, g.token_ids[0])) if a != b),
                              min(len(ref), len(g.token_ids[0])))
                mm = {"method": label, "category": p.category, "qid": p.qid, "first_diff": n_same,
                      "ref_len": len(ref), "got_len": len(g.token_ids[0]), "prompt": p.text[:300]}
                mismatches.append(mm)
                tag = "transformers differs (info)" if label == HF_PLD else "LOSSLESS MISMATCH"
                print(f"  {tag}: {label} on {p.category}/{p.qid} at token {n_same}", flush=True)
        line = "  ".join(f"{lab}={timings[p.category][lab][-1].decode_tok_s:.1f}" for lab in labels)
        print(f"[{i + 1}/{len(prompts)} {p.category}/{p.qid} prompt={len(p_ids)} "
              f"out={len(ref)} {time.perf_counter() - t_start:.0f}s] {line}", flush=True)

    result = _summarise(args, prompts, labels, timings, stats, profiles, mismatches)
    write_json(args.json, result)
    if args.markdown:
        replace_section(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"),
                        args.section, result["markdown"])
    if args.figures:
        _figures(result, os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures"), args.figure_prefix)
    return result


def _cpu_model() -> str:
    """CPU model and the vector extensions the C kernels pick from (``/proc/cpuinfo``)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return "CPU unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "CPU")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX'})"


def _merge_profile(acc: StepProfile, p: StepProfile) -> None:
    for k, v in p.seconds.items():
        acc.seconds[k] += v
    for k, v in p.calls.items():
        acc.calls[k] += v
    acc.steps += p.steps
    acc.step_total_s += p.step_total_s
    for k, v in p.execute_by_tokens.items():
        acc.execute_by_tokens[k].extend(v)


def _tok_s(gs: list[GenTiming]) -> float:
    """Decode tokens/s over a set of prompts: sum of tokens after the first / sum of decode time."""
    n = sum(g.num_tokens - 1 for g in gs)
    t = sum(g.decode_s for g in gs)
    return n / t if t > 0 else float("nan")


def _summarise(args, prompts, labels, timings, stats, profiles, mismatches) -> dict:
    from tokenbudget.spec.metrics import SpecDecodingStats

    cats = list(dict.fromkeys(p.category for p in prompts))
    spec_labels = [lab for lab in labels if lab not in (BASE, HF_PLD)]
    has_hf = HF_PLD in labels
    bad = {(m["method"], m["category"]) for m in mismatches if m["method"] != HF_PLD}
    rows, data = [], []
    for cat in cats + ["ALL"]:
        cs = cats if cat == "ALL" else [cat]
        gs = {lab: [g for c in cs for g in timings[c][lab]] for lab in labels}
        base = _tok_s(gs[BASE])
        hf = _tok_s(gs[HF_PLD]) if has_hf else float("nan")
        for lab in [BASE] + spec_labels + ([HF_PLD] if has_hf else []):
            st = SpecDecodingStats()
            for c in cs:
                if lab in stats[c]:
                    st.merge(stats[c][lab])
            v = _tok_s(gs[lab])
            lossless = ("-" if lab in (BASE, HF_PLD)
                        else "no" if any((lab, c) in bad for c in cs) else "yes")
            if lab == HF_PLD:
                same = sum(1 for c in cs for m in mismatches if m["method"] == HF_PLD and m["category"] == c)
                lossless = f"({len(gs[lab]) - same}/{len(gs[lab])} = tb)"
            byp = ",".join(f"{a:.2f}" for a in st.acceptance_by_position()) if st.num_drafts else "-"
            tau = st.mean_accepted_length if st.num_drafts else float("nan")
            row = [cat, lab, tau, byp, v, f"{v / base:.2f}x", f"{v / hf:.2f}x" if has_hf else "-", lossless]
            rows.append(row)
            data.append({"category": cat, "method": lab, "prompts": len(gs[lab]),
                         "tokens": sum(g.num_tokens for g in gs[lab]), "decode_tok_s": v,
                         "e2e_tok_s": sum(g.num_tokens for g in gs[lab]) / sum(g.total_s for g in gs[lab]),
                         "speedup_vs_nospec": v / base, "speedup_vs_hf_pld": v / hf if has_hf else None,
                         "lossless": lossless, "spec_stats": st.as_dict() if st.num_drafts else None})
    headers = ["category", "method", "τ", "α by position", "decode tok/s", "vs no-spec",
               f"vs HF PLD k={args.hf_pld_k}", "lossless"]
    print()
    print_table(headers, rows)

    prof_headers = ["method", "ms/step", "steps"] + list(next(iter(profiles.values())).split().keys())
    prof_rows = []
    for lab, pr in profiles.items():
        sp = pr.split()
        tot = pr.step_total_s
        prof_rows.append([lab, 1000 * tot / max(pr.steps, 1), pr.steps]
                         + [f"{100 * v / tot:.1f}%" if tot else "-" for v in sp.values()])
    print("\nWhere a step's time goes (share of LLMEngine.step time, all prompts):")
    print_table(prof_headers, prof_rows)
    by_tokens: dict[int, list[float]] = defaultdict(list)
    for pr in profiles.values():
        for n, v in pr.execute_by_tokens.items():
            by_tokens[n].extend(v)
    sizes = [n for n in sorted(by_tokens) if n <= 17]
    cost_headers = ["tokens in step"] + [str(n) for n in sizes]
    cost_rows = [["runner.execute ms (median)"] + [1000 * median(by_tokens[n]) for n in sizes],
                 ["vs 1 token"] + [median(by_tokens[n]) / median(by_tokens[1]) if 1 in by_tokens else float("nan")
                                   for n in sizes],
                 ["steps measured"] + [len(by_tokens[n]) for n in sizes]]
    print("\nVerify cost: runner.execute time by tokens in the step (batch 1: 1 + drafts):")
    print_table(cost_headers, cost_rows)
    real = [m for m in mismatches if m["method"] != HF_PLD]
    verdict = "yes, every method matched no-spec on every prompt" if not real else f"NO: {len(real)} mismatches"
    print(f"\nlossless: {verdict}")
    for m in real:
        print("  MISMATCH", m)

    cmd = (f"PYTHONPATH=. python benches/spec_cpu.py --per-category {args.per_category} "
           f"--max-new-tokens {args.max_new_tokens} --max-prompt-tokens {args.max_prompt_tokens} "
           f"--threads {args.threads} --methods {' '.join(args.methods)} --hf-pld-k {args.hf_pld_k} "
           + (f"--categories {' '.join(args.categories)} " if args.categories else "")
           + ("--no-hf " if args.no_hf else "")
           + (f"--kernels {args.kernels} --section '{args.section}' --figure-prefix {args.figure_prefix} "
              if args.kernels != "c" or args.figure_prefix != "spec" else "") +
           "--markdown --figures")
    weights = ("Q4_1 GGUF as int4 on the C kernels + C decoder forward" if args.kernels == "c"
               else "fp32 (unquantized) on torch's kernels")
    md = (f"`{cmd}` ({time.strftime('%Y-%m-%d')}; {_cpu_model()}, {args.threads} threads; "
          f"SmolLM2-135M-Instruct, {weights}, greedy, batch 1, "
          f"{args.per_category} prompt(s) per Spec-Bench category (first turn, chat template, capped at "
          f"{args.max_prompt_tokens} tokens) + code editing; EOS honoured; {os.cpu_count()} shared cores, "
          f"load average {os.getloadavg()[0]:.1f} at the end). Decode tokens/s excludes prefill; "
          f"speedups are ratios of runs interleaved prompt by prompt in the same process. "
          f"HF PLD = transformers `generate(prompt_lookup_num_tokens={args.hf_pld_k})` on the same "
          f"weights; its 'lossless' cell counts prompts whose tokens equal tokenbudget's.\n\n"
          + markdown_table(headers, rows)
          + "\n\nShare of `LLMEngine.step` time per component (all prompts):\n\n"
          + markdown_table(prof_headers, prof_rows)
          + "\n\nVerify cost: `runner.execute` time by tokens in the step (1 + drafts at batch 1):\n\n"
          + markdown_table(cost_headers, cost_rows)
          + _k_choice_table(data)
          + "\n\nLossless: " + ("every method produced exactly the no-speculation tokens on every prompt."
                                if not real else f"{len(real)} MISMATCHES (see JSON)") + "\n")
    if args.figures:
        pre = args.figure_prefix
        md += (f"\n![acceptance by position](figures/{pre}_acceptance_by_position.png)\n"
               f"![speedup by category](figures/{pre}_speedup_by_category.png)\n")
    return {"machine": machine_info(args.threads), "args": vars(args), "rows": data,
            "profile": {lab: {"ms_per_step": r[1], "steps": r[2], **dict(zip(prof_headers[3:], r[3:]))}
                        for lab, r in zip(profiles, prof_rows)},
            "execute_ms_by_tokens": {n: 1000 * median(v) for n, v in sorted(by_tokens.items()) if n <= 64},
            "mismatches": mismatches, "markdown": md, "categories": cats}


def _k_choice_table(data: list[dict]) -> str:
    """Per category, the share of verify steps at each draft length for the ``k=auto`` methods
    (k = 0: the controller turned speculation off for that step)."""
    rows = []
    for r in data:
        if "k=auto" not in r["method"]:
            continue
        st = r["spec_stats"]
        hist = {int(k): v for k, v in (st or {}).get("k_histogram", {}).items()}
        total = sum(hist.values())
        if not total:
            continue
        off = hist.get(0, 0) / total
        mean_k = sum(k * v for k, v in hist.items()) / total
        rows.append([r["category"], r["method"], f"{off:.0%}", f"{mean_k:.2f}", max(hist)])
    if not rows:
        return ""
    return ("\n\nWhat the controller chose (`k=auto`): share of steps with no drafts, mean k, largest k:\n\n"
            + markdown_table(["category", "method", "k = 0", "mean k", "max k"], rows))


def _figures(result: dict, out_dir: str, prefix: str = "spec") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    rows = [r for r in result["rows"] if r["category"] == "ALL" and r["spec_stats"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        a = r["spec_stats"]["acceptance_by_position"]
        ax.plot(range(1, len(a) + 1), a, marker="o", label=r["method"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | proposed)")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by draft position (all prompts)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{prefix}_acceptance_by_position.png"), dpi=110)
    plt.close(fig)

    cats = result["categories"] + ["ALL"]
    methods = [m for m in dict.fromkeys(r["method"] for r in result["rows"]) if m != BASE]
    fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.9), 4.5))
    w = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        ys = [next((r["speedup_vs_nospec"] for r in result["rows"]
                    if r["category"] == c and r["method"] == m), 0) for c in cats]
        ax.bar([i + j * w for i in range(len(cats))], ys, w, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cats))])
    ax.set_xticklabels(cats, rotation=40, ha="right")
    ax.set_ylabel("decode speedup vs no speculation")
    ax.set_title("Speedup by category (batch 1, greedy, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{prefix}_speedup_by_category.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
