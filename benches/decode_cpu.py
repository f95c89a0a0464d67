"""CPU greedy decode throughput: tokenbudget (no speculation) vs transformers ``generate``.

Same weights (the default model dequantized to fp32), same chat-templated Spec-Bench prompts,
same ``max_new_tokens`` (EOS ignored on both sides so every run decodes exactly that many),
same thread count (``torch.set_num_threads(--threads)``). Batch 1 and batch 8, interleaved
repeat by repeat (tokenbudget, transformers, tokenbudget, ...) so machine noise hits both; the
table shows medians of decode tokens/s (prefill excluded: from the first generated token to the
last), median time to first token, and the ratio tokenbudget / transformers.

    PYTHONPATH=. python benches/decode_cpu.py --threads 2 --max-new-tokens 64 --repeats 3 \
        --json benches/results/decode_cpu.json [--markdown]

At batch 8, transformers gets a left-padded batch (its usual use); its TTFT comes from a
separate ``max_new_tokens=1`` call. "same tokens" compares the greedy outputs at batch 1
(informational: fp32 kernels differ, so a near-tie may flip).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benches.common import (  # noqa: E402
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
from benches.workloads import chat_token_ids, spec_bench  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quantization", default="none",
                    help="tokenbudget's weights: none (fp32, the same weights as transformers; the "
                         "recorded figures) | auto | int8 | int4")
    ap.add_argument("--markdown", action="store_true", help="write '## CPU decode' into benches/RESULTS.md")
    args = ap.parse_args(argv)

    from tokenbudget import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, quantization=args.quantization)
    hf, tok = load_hf_model(args.threads)
    eos = llm.engine.model_config.eos_token_ids
    cats = ("writing", "roleplay", "reasoning", "math", "coding", "stem", "humanities", "qa")
    prompts = [chat_token_ids(tok, p.text) for p in spec_bench(1, cats)]
    n = args.max_new_tokens

    # warm-up: first calls pay oneDNN primitive creation / allocator growth
    for b in args.batch_sizes:
        engine_generate(llm, prompts[:b], 8, ignore_eos=True)
        hf_generate(hf, prompts[:b], 8, ignore_eos=True, pad_id=eos[0], eos_ids=eos)

    runs: dict[tuple[str, int], list] = {}
    same: list[bool] = []
    for r in range(args.repeats):
        for b in args.batch_sizes:
            # batch 1 cycles through the prompts; batch b takes b prompts
            batch = [prompts[r % len(prompts)]] if b == 1 else [prompts[i % len(prompts)] for i in range(b)]
            g = engine_generate(llm, batch, n, ignore_eos=True)
            h = hf_generate(hf, batch, n, ignore_eos=True, pad_id=eos[0], eos_ids=eos)
            runs.setdefault(("tokenbudget", b), []).append(g)
            runs.setdefault(("transformers", b), []).append(h)
            if b == 1:
                same.append(g.token_ids[0] == h.token_ids[0])
            print(f"[repeat {r} batch {b}] tokenbudget {g.decode_tok_s:.2f} tok/s  "
                  f"transformers {h.decode_tok_s:.2f} tok/s", flush=True)

    headers = ["batch", "engine", "decode tok/s", "e2e tok/s", "TTFT s", "vs transformers (decode)"]
    rows, result = [], {"machine": machine_info(args.threads), "max_new_tokens": n,
                        "repeats": args.repeats, "results": []}
    for b in args.batch_sizes:
        tb = median([g.decode_tok_s for g in runs[("tokenbudget", b)]])
        for name in ("tokenbudget", "transformers"):
            gs = runs[(name, b)]
            dec = median([g.decode_tok_s for g in gs])
            ratio = tb / dec if name == "transformers" else 1.0
            row = [b, name, dec, median([g.e2e_tok_s for g in gs]), median([g.ttft_s for g in gs]),
                   f"{tb / dec:.2f}x" if name == "transformers" else ""]
            rows.append(row)
            result["results"].append({"batch": b, "engine": name, "decode_tok_s": dec,
                                      "e2e_tok_s": row[3], "ttft_s": row[4],
                                      "tokenbudget_over_transformers": ratio,
                                      "decode_tok_s_runs": [g.decode_tok_s for g in gs]})
    result["same_tokens_batch1"] = same
    print()
    print(f"threads={args.threads} max_new_tokens={n} repeats={args.repeats} "
          f"loadavg={os.getloadavg()[0]:.1f}")
    print_table(headers, rows)
    print(f"batch-1 greedy tokens identical to transformers: {sum(same)}/{len(same)}")
    write_json(args.json, result)
    if args.markdown:
        body = (f"`PYTHONPATH=. python benches/decode_cpu.py --threads {args.threads} --max-new-tokens {n} "
                f"--repeats {args.repeats} --markdown` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} shared "
                f"cores, load average {os.getloadavg()[0]:.1f} at the end; medians of interleaved runs)\n\n"
                + markdown_table(headers, rows)
                + f"\n\nBatch-1 greedy tokens identical to transformers: {sum(same)}/{len(same)}.\n")
        replace_section(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "CPU decode", body)
    return result


if __name__ == "__main__":
    main()
