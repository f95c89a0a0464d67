"""CPU side by side: tokenbudget vs llama.cpp (llama-cpp-python) vs transformers, one interleaved run.

    PYTHONPATH=. python benches/cpu_peers.py --threads 2 --prompts-per-workload 3 --repeats 1 \
        --json benches/results/cpu_peers.json --markdown

Same model for everybody: the default GGUF (SmolLM2-135M-Instruct Q4_1). tokenbudget and
llama.cpp load that file; transformers gets its weights dequantized to fp32. Same thread count
(``--threads``: torch threads, llama.cpp ``n_threads``/``n_threads_batch``), the same
chat-templated prompt token ids, greedy, batch 1, ``--max-new-tokens`` with EOS ignored on every
side, so every run generates exactly that many tokens. The modes and how each engine is called
are in ``benches/peer_engines.py``; vLLM-CPU is listed as skipped unless ``import vllm`` works
(it is not run by this bench either way).

Workloads, ``--prompts-per-workload`` N prompts each:

* code editing: ``workloads.code_editing(N)`` ("rewrite this function so that ...": the answer
  mostly copies the prompt);
* summarization: the first N Spec-Bench "summarization" questions;
* open chat: Spec-Bench "writing", "roleplay" and "qa", taken in turn (writing 1, roleplay 1,
  qa 1, writing 2, ...): free-form answers where prompt lookup rarely finds a draft.

Interleaving: prompts alternate between workloads; each prompt runs every mode once, the order
of the modes rotating by one from one prompt to the next; all of it ``--repeats`` times. tok/s =
generated tokens / wall seconds of the run, prefill included; a workload's figure is the median
over its runs (prompts x repeats). "= plain": prompts on which a mode's greedy tokens equal its
own engine's plain tokens on every repeat. tokenbudget's speculative modes must equal its plain
decoding (the project's invariant): any difference is printed as a warning.

Batch throughput (``--batch-prompts``, 0 skips it): that many prompts cycled from the ones above,
``--batch-max-new-tokens`` each, all submitted at once: tokenbudget with ``max_num_seqs`` = each
``--max-batch`` (its default KV pool, sized from ``max_num_seqs``; the pool's size is recorded), transformers
in left-padded batches of that size, llama.cpp one prompt after another (llama-cpp-python has no
batched generate). Output tok/s = all generated tokens / wall seconds.

Kernel variants (``--variants avx2 scalar 0 ...``): one more tokenbudget plain mode per C kernel
variant (kernels/cpu/native.py), labelled ``tokenbudget [avx2]``: the same engine and packed
weights as ``tokenbudget-plain``, with ``TOKENBUDGET_NATIVE`` set to the variant around each of
its calls (the library is picked per call); ``0`` builds a second engine on torch's kernels. Run
llama.cpp from a llama-cpp-python built for the instruction set compared against (RESULTS.md says
how it was built).

The process holds three engines at once, so its RSS says nothing about any of them: not reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as tokenbudget/__init__ does, before torch loads libgomp

import torch  # noqa: E402

from benches import peer_engines as pe  # noqa: E402
from benches.common import machine_info, markdown_table, median, print_table, replace_section, write_json  # noqa: E402
from benches.workloads import chat_token_ids, code_editing, spec_bench  # noqa: E402

WORKLOADS = ("code editing", "summarization", "open chat")
CHAT_CATEGORIES = ("writing", "roleplay", "qa")
TITLE = "CPU peers: tokenbudget vs llama.cpp vs transformers"
REF = "llamacpp-plain"


def workload_prompts(n: int) -> list[tuple[str, str]]:
    """``n`` (workload, user text) per workload, alternating workloads: code, summary, chat, code, ..."""
    chat_pool = spec_bench(-(-n // len(CHAT_CATEGORIES)), CHAT_CATEGORIES)
    by_cat = [[p for p in chat_pool if p.category == c] for c in CHAT_CATEGORIES]
    chat = [by_cat[i % 3][i // 3] for i in range(n)]
    per = {"code editing": code_editing(n), "summarization": spec_bench(n, ("summarization",)), "open chat": chat}
    return [(w, per[w][i].text) for i in range(n) for w in WORKLOADS]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(pe.MODES), choices=pe.MODES)
    ap.add_argument("--prompts-per-workload", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch-prompts", type=int, default=64)
    ap.add_argument("--max-batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--batch-max-new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 prompt per workload, 16 new tokens, 8 batch prompts at max batch 1 and 8")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="C kernel variants to add as tokenbudget plain modes (avx512_vnni, avx_vnni, avx2, "
                         "neon, scalar; 0 = torch's kernels)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help=f"write '## {TITLE}' into benches/RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts_per_workload, args.max_new_tokens, args.repeats = 1, 16, 1
        args.batch_prompts, args.max_batch, args.batch_max_new_tokens = 8, [1, 8], 16
    for name in ("threads", "prompts_per_workload", "max_new_tokens", "repeats", "batch_max_new_tokens"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from tokenbudget.engine.loader.default_model import default_model_path

    torch.set_num_threads(args.threads)
    machine = {**machine_info(args.threads), "cpu": cpu_model()}  # load average before any engine ran
    skipped = {e: r for e in ("llamacpp", "vllm") if (r := pe.missing_reason(e))}
    for engine, why in skipped.items():
        print(f"skipping {engine}: {why}" + (" (the bench never runs vLLM-CPU)" if engine == "vllm" else ""))
    modes = [m for m in pe.MODES if m in args.modes and pe.engine_of(m) not in skipped]
    model_path = default_model_path()

    t0 = time.perf_counter()
    tb_plain = pe.TokenbudgetEngine("tokenbudget-plain", args.threads)  # tokenizer, EOS, KV geometry
    tok = tb_plain.llm.tokenizer
    texts = workload_prompts(args.prompts_per_workload)
    prompts = [(w, chat_token_ids(tok, text, args.max_prompt_tokens)) for w, text in texts]
    n_ctx = max(len(p) for _, p in prompts) + max(args.max_new_tokens, args.batch_max_new_tokens) + 64
    hf = None
    if any(pe.engine_of(m) == "transformers" for m in modes):
        hf = pe.TransformersModel(args.threads, pad_id=tb_plain.llm.engine.model_config.eos_token_ids[0])
    runners = {}
    for m in modes:
        if m == "tokenbudget-plain":
            runners[m] = tb_plain
        elif pe.engine_of(m) == "tokenbudget":
            runners[m] = pe.TokenbudgetEngine(m, args.threads)
        elif pe.engine_of(m) == "llamacpp":
            runners[m] = pe.llama_runner(m, model_path, args.threads, n_ctx)
        else:
            runners[m] = hf.runner(m)
    for variant in args.variants:
        mode = f"tokenbudget-plain@{variant}"
        base = tb_plain
        if variant == "0":
            with pe.native_variant("0"):
                base = pe.TokenbudgetEngine("tokenbudget-plain", args.threads)
        runners[mode] = pe.VariantRunner(base, variant)
        modes.append(mode)
    print(f"loaded {len(runners)} modes in {time.perf_counter() - t0:.0f}s; {len(prompts)} prompts "
          f"(lengths {[len(p) for _, p in prompts]})", flush=True)

    runs = run_interleaved(runners, prompts, args)
    from tokenbudget.kernels.cpu import native
    kernels = f"C {native.selected_variant()}" if native.selected_variant() else "torch's kernels"
    result = {"machine": machine, "versions": versions(), "kernels": kernels,
              "args": vars(args), "command": command(argv), "skipped": skipped, "model_path": model_path,
              "workloads": list(WORKLOADS), "prompt_tokens": [len(p) for _, p in prompts],
              **summarise(modes, runs, args), "batch": None}
    save(result, args)  # the batch section is long: keep the batch-1 table if it fails
    if args.batch_prompts > 0:
        result["batch"] = batch_section(args, prompts, runners, hf)
        save(result, args)
    return result


def save(result: dict, args) -> None:
    result["machine"]["load_at_end"] = os.getloadavg()
    result["markdown"] = markdown(result)
    write_json(args.json, result)
    if args.markdown:
        replace_section(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), TITLE,
                        result["markdown"])


def run_interleaved(runners: dict, prompts: list[tuple[str, list[int]]], args) -> dict[str, list[dict]]:
    """Every mode on every prompt, ``args.repeats`` times, mode order rotating per prompt."""
    modes = list(runners)
    for m in modes:  # warm-up: kernel primitives, allocator growth, first-call paths
        runners[m]([prompts[0][1]], 8)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    t_start, turn = time.perf_counter(), 0
    for r in range(args.repeats):
        for i, (workload, ids) in enumerate(prompts):
            order = modes[turn % len(modes):] + modes[:turn % len(modes)]
            turn += 1
            for m in order:
                g = runners[m]([ids], args.max_new_tokens)
                runs[m].append({"workload": workload, "prompt": i, "repeat": r, "prompt_tokens": len(ids),
                                "tokens": g.num_tokens, "total_s": g.total_s, "ttft_s": g.ttft_s,
                                "tok_s": g.e2e_tok_s, "load1": os.getloadavg()[0],
                                "token_ids": g.token_ids[0]})
            line = "  ".join(f"{m}={runs[m][-1]['tok_s']:.1f} (ttft {runs[m][-1]['ttft_s']:.2f})" for m in modes)
            print(f"[rep {r + 1} prompt {i + 1}/{len(prompts)} {workload}, {len(ids)} tokens, "
                  f"{time.perf_counter() - t_start:.0f}s] {line}", flush=True)
    return runs


def equal_to_plain(mode: str, runs: dict[str, list[dict]]) -> tuple[int, int] | None:
    """(prompts whose every repeat equals the engine's plain tokens, prompts); None without a plain run."""
    plain = f"{pe.engine_of(mode)}-plain"
    if mode == plain or plain not in runs:
        return None
    ref = {}
    for run in runs[plain]:
        ref.setdefault(run["prompt"], run["token_ids"])
    same = {}
    for run in runs[mode]:
        same[run["prompt"]] = same.get(run["prompt"], True) and run["token_ids"] == ref[run["prompt"]]
    return sum(same.values()), len(same)


def summarise(modes: list[str], runs: dict[str, list[dict]], args) -> dict:
    tok_s = {m: {w: median([r["tok_s"] for r in runs[m] if r["workload"] == w]) for w in WORKLOADS}
             for m in modes}
    ref = tok_s.get(REF)
    rows, out, warnings = [], {}, []
    for m in modes:
        ratio = {w: tok_s[m][w] / ref[w] if ref else float("nan") for w in WORKLOADS}
        eq = equal_to_plain(m, runs)
        rows.append([pe.label(m), *(tok_s[m][w] for w in WORKLOADS), *(ratio[w] for w in WORKLOADS),
                     f"{eq[0]}/{eq[1]}" if eq else "–"])
        if eq and eq[0] < eq[1] and pe.engine_of(m) == "tokenbudget" and "@" not in m:
            warnings.append(f"{m} differs from tokenbudget plain on {eq[1] - eq[0]} of {eq[1]} prompts: "
                            "speculative output must equal plain decoding (project invariant broken)")
        out[m] = {"label": pe.label(m), "tok_s": tok_s[m], "vs_llamacpp_plain": ratio if ref else None,
                  "equal_to_plain": list(eq) if eq else None, "runs": runs[m]}
    headers = ["engine, mode", *(f"{w} tok/s" for w in WORKLOADS), *(f"{w} / llama.cpp" for w in WORKLOADS),
               "= plain"]
    print(f"\nbatch 1, greedy, {args.max_new_tokens} new tokens (EOS ignored), {args.threads} threads; "
          f"median tok/s over {args.prompts_per_workload} prompt(s) x {args.repeats} repeat(s) per workload, "
          "prefill included:")
    print_table(headers, rows)
    for w in warnings:
        print(f"\n!!!!!!!! WARNING: {w} !!!!!!!!")
    return {"modes": out, "table": {"headers": headers, "rows": rows}, "warnings": warnings}


def batch_section(args, prompts, runners: dict, hf) -> dict:
    """Throughput on ``args.batch_prompts`` prompts at each max batch, per engine whose plain mode ran."""
    ids = [prompts[i % len(prompts)][1] for i in range(args.batch_prompts)]
    n = args.batch_max_new_tokens
    cells: dict[tuple[str, int], dict] = {}
    configs = [("tokenbudget", b) for b in args.max_batch if "tokenbudget-plain" in runners]
    configs += [("transformers", b) for b in args.max_batch if hf is not None and "transformers-plain" in runners]
    configs += [("llamacpp", 1)] if "llamacpp-plain" in runners else []
    print(f"\nbatch throughput: {len(ids)} prompts, {n} new tokens each", flush=True)
    kv = {}
    for engine, b in configs:
        if engine == "tokenbudget":
            run = pe.TokenbudgetEngine("tokenbudget-plain", args.threads, max_num_seqs=b)
            kv[b] = kv_pool_bytes(run.llm)
            run(ids[:2], 4)  # warm-up
            g = run(ids, n)
            del run
        elif engine == "transformers":
            runner = runners["transformers-plain"]
            parts = [runner(ids[i:i + b], n) for i in range(0, len(ids), b)]
            g = pe.concat_timings(parts)
        else:
            g = runners["llamacpp-plain"](ids, n)
        cells[(engine, b)] = {"engine": engine, "max_batch": b, "tokens": g.num_tokens, "total_s": g.total_s,
                              "tok_s": g.e2e_tok_s, "load1": os.getloadavg()[0], "token_ids": g.token_ids}
        print(f"  {engine} max batch {b}: {g.e2e_tok_s:.1f} tok/s ({g.num_tokens} tokens in {g.total_s:.1f}s)",
              flush=True)
    rows = []
    for (engine, b), c in cells.items():
        b1 = cells.get((engine, 1))
        c["equal_to_b1"] = sum(x == y for x, y in zip(c["token_ids"], b1["token_ids"])) if b1 else None
        rows.append([pe.LABELS[f"{engine}-plain"], b, c["tok_s"], c["total_s"],
                     f"{c['equal_to_b1']}/{len(ids)}" if b1 and b > 1 else "–"])
    top = max(args.max_batch)
    ratios = {}
    tb, llama, tr = cells.get(("tokenbudget", top)), cells.get(("llamacpp", 1)), cells.get(("transformers", top))
    if tb and llama:
        ratios[f"tokenbudget b{top} / llama.cpp b1"] = tb["tok_s"] / llama["tok_s"]
    if tb and tr:
        ratios[f"tokenbudget b{top} / transformers b{top}"] = tb["tok_s"] / tr["tok_s"]
    headers = ["engine", "max batch", "output tok/s", "wall s", "tokens = its b1"]
    print_table(headers, rows)
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    return {"prompts": len(ids), "max_new_tokens": n, "kv_pool_bytes": kv, "ratios": ratios,
            "cells": [{k: v for k, v in c.items() if k != "token_ids"} for c in cells.values()],
            "table": {"headers": headers, "rows": rows}}


def kv_pool_bytes(llm) -> int:
    """Bytes of the engine's KV pool (its default: sized from ``max_num_seqs`` and the machine)."""
    from tokenbudget.engine.worker.kv_cache_alloc import kv_cache_block_bytes

    eng = llm.engine
    return eng.scheduler.config.num_blocks * kv_cache_block_bytes(eng.model_config, eng.config.block_size,
                                                                  eng.target.dtype)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        return "?"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "transformers", "llama-cpp-python"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def command(argv: list[str]) -> str:
    return "PYTHONPATH=. python benches/cpu_peers.py " + " ".join(argv)


def markdown(res: dict) -> str:
    a, m, v = res["args"], res["machine"], res["versions"]
    text = (f"`{res['command']}` ({time.strftime('%Y-%m-%d')}; {m['cpus']}-core {m['cpu']}, load average "
            f"{m['loadavg_at_start'][0]:.1f} at the start, {m['load_at_end'][0]:.1f} at the end (per-run loads in "
            f"the JSON); {a['threads']} threads each; torch {v['torch']}, "
            f"transformers {v['transformers']}, llama-cpp-python {v['llama-cpp-python']}; tokenbudget's kernels: "
            f"{res.get('kernels', '?')}). SmolLM2-135M-Instruct, the "
            f"same Q4_1 GGUF for tokenbudget (default options: `quantization=\"auto\"` = int4) and llama.cpp, "
            f"fp32 weights for transformers; the same chat-templated prompt ids; greedy, batch 1, "
            f"{a['max_new_tokens']} new tokens with EOS ignored. tok/s = generated tokens / wall seconds, prefill "
            f"included, median over {a['prompts_per_workload']} prompt(s) x {a['repeats']} repeat(s) per workload "
            "(open chat = Spec-Bench writing / roleplay / qa), modes interleaved prompt by prompt. "
            "\"= plain\": prompts whose greedy tokens equal the same engine's plain output.\n\n")
    text += markdown_table(res["table"]["headers"], res["table"]["rows"]) + "\n"
    for engine, why in res["skipped"].items():
        text += f"\n{engine} not measured: {why}.\n"
    for w in res["warnings"]:
        text += f"\n**WARNING: {w}**\n"
    b = res["batch"]
    if b:
        text += (f"\nBatch throughput: {b['prompts']} prompts (cycled from the ones above), {b['max_new_tokens']} "
                 f"new tokens each, EOS ignored, all submitted at once; tokenbudget `max_num_seqs` = max batch "
                 "(default KV pool: "
                 f"{', '.join(f'{v / 2**30:.1f} GiB at {k}' for k, v in b['kv_pool_bytes'].items())}), "
                 "transformers in left-padded "
                 "batches of that size, llama.cpp one prompt after another (llama-cpp-python has no batched "
                 "generate). One run each.\n\n" + markdown_table(b["table"]["headers"], b["table"]["rows"]) + "\n\n")
        text += "".join(f"* {k}: {r:.2f}x\n" for k, r in b["ratios"].items())
    return text


if __name__ == "__main__":
    main()
