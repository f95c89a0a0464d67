"""What the EAGLE-3 head's C forward (``engine.model.eagle3_cpu``, one ``tb_eagle3`` call per draft
step) saves against the head's torch forward, in the engine: the same LLM, its proposer's
``cpu_forward`` switched off and on, against plain decoding, prompt by prompt in rotating order.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benches/eagle3_head_step.py --per-category 2 --k 4 auto \
        --max-new-tokens 128 --threads 1 [--json out.json]

Batch 1, greedy, the default model (int4 on the C kernels) and its shipped head, Spec-Bench
prompts of the chosen categories (chat-templated, cut to ``--max-prompt-tokens``), no prefix
caching. Per configuration: decode tokens/s (after the first token, as ``spec_cpu``) and its
ratio to plain over the whole run, τ (tokens per verify of a drafted request), and the drafter's
time per ``propose`` call (the head's catch-up and draft steps, sampling included) and per
drafted token. Every output must equal plain decoding. First, one draft step alone: the torch
forward against the C call, warm (a loop) and cold (after streaming 64 MB, as the target's
forward does between two draft steps).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.common import engine_generate, machine_info, print_table, write_json  # noqa: E402
from benches.workloads import chat_token_ids, spec_bench  # noqa: E402


def one_step_micro(proposer, context: int = 300, rounds: int = 300) -> list[dict]:
    """One draft step of one row (after ``context`` cached rows), the torch forward (embedding
    lookup, head, argmax) against the C call: warm (a loop) and cold (after streaming 64 MB, as a
    target forward does between two draft steps); median microseconds."""
    import statistics

    import torch

    from tokenbudget.engine.drafters.eagle3_kv import HeadState, segment_attend

    head, embed, c_forward = proposer.head, proposer.embed, proposer.cpu_forward
    c = head.config
    kv = torch.zeros(2, context + 8, c.num_key_value_heads, c.head_dim)
    hidden = torch.randn(1, c.hidden_size)
    state = HeadState(kv.clone(), n=context)

    def torch_step():
        with torch.inference_mode():
            h, logits = head(embed[torch.tensor([5])], hidden, torch.tensor([context]),
                             segment_attend([(state, context, 1)]))
            return head.to_target_ids(logits.argmax(-1)).tolist()

    ways = {"torch forward": torch_step, "C call": lambda: c_forward([5], hidden, [context], [(kv, context, 1)], False)}
    flush = torch.zeros(16 << 20)
    out = []
    for name, step in ways.items():
        for _ in range(20):
            step()
        warm = []
        for _ in range(rounds):
            t = time.perf_counter()
            step()
            warm.append(time.perf_counter() - t)
        cold = []
        for _ in range(max(20, rounds // 10)):
            flush.add_(1.0)
            t = time.perf_counter()
            step()
            cold.append(time.perf_counter() - t)
        out.append({"way": name, "warm_us": statistics.median(warm) * 1e6, "cold_us": statistics.median(cold) * 1e6})
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--categories", nargs="+", default=["writing", "roleplay", "qa", "math_reasoning"])
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--k", nargs="+", default=["4", "auto"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-prompt-tokens", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from tokenbudget import LLM

    # no prefix caching: each prompt runs twice on one engine (torch head, C head), and a cache hit
    # would skip the second run's prefill and the head's rows for it
    common = dict(num_threads=args.threads, max_model_len=args.max_prompt_tokens + args.max_new_tokens + 64,
                  kv_cache_memory_bytes=256 * 1024 * 1024, enable_prefix_caching=False)
    plain = LLM(**common)
    tok = plain.tokenizer
    prompts = [chat_token_ids(tok, p.text, args.max_prompt_tokens)
               for p in spec_bench(args.per_category, tuple(args.categories))]
    engines = {}
    for k in args.k:
        llm = LLM(**common, speculative_config={
            "method": "eagle3", "num_speculative_tokens": k if k == "auto" else int(k)})
        proposer = llm.engine.speculator.proposer
        if proposer.cpu_forward is None:
            raise SystemExit("the head's C forward is not built here (no C kernels?): nothing to compare")
        engines[k] = (llm, proposer, proposer.cpu_forward)

    micro = one_step_micro(engines[args.k[0]][1])
    print_table(["one draft step", "warm µs", "cold µs"],
                [[m["way"], f"{m['warm_us']:.0f}", f"{m['cold_us']:.0f}"] for m in micro])
    print()
    configs = ["plain"] + [f"k={k} {way}" for k in args.k for way in ("torch head", "C head")]
    totals = {c: {"seconds": 0.0, "tokens": 0, "propose_s": 0.0, "steps": 0} for c in configs}
    spec_before = {}

    def run(config: str, ids: list[int]):
        if config == "plain":
            return engine_generate(plain, [ids], args.max_new_tokens)
        k, way = config.split(" ", 1)
        llm, proposer, c_forward = engines[k.removeprefix("k=")]
        proposer.cpu_forward = c_forward if way == "C head" else None
        inner, spent = proposer.propose, [0.0, 0]

        def timed(requests, num_tokens):
            t = time.perf_counter()
            try:
                return inner(requests, num_tokens)
            finally:
                spent[0] += time.perf_counter() - t
                spent[1] += 1

        proposer.propose = timed
        try:
            out = engine_generate(llm, [ids], args.max_new_tokens)
        finally:
            del proposer.propose
        cell = totals[config]
        cell["propose_s"] += spent[0]
        cell["steps"] += spent[1]
        return out

    for i, ids in enumerate(prompts):
        order = configs[i % len(configs):] + configs[:i % len(configs)]
        outs = {}
        for config in order:
            if config != "plain":
                llm = engines[config.split(" ", 1)[0].removeprefix("k=")][0]
                st = llm.get_spec_stats()
                spec_before[config] = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
            timing = run(config, ids)
            outs[config] = timing.token_ids[0]
            totals[config]["seconds"] += timing.decode_s  # after the first token: decoding alone
            totals[config]["tokens"] += len(outs[config]) - 1
            if config != "plain":
                after = llm.get_spec_stats()
                cell = totals[config]
                drafts, draft_tokens, accepted = spec_before[config]
                cell["drafted_verifies"] = cell.get("drafted_verifies", 0) + after.num_drafts - drafts
                cell["draft_tokens"] = cell.get("draft_tokens", 0) + after.num_draft_tokens - draft_tokens
                cell["accepted"] = cell.get("accepted", 0) + after.num_accepted_tokens - accepted
        want = outs["plain"]
        bad = [c for c, o in outs.items() if o != want]
        if bad:
            raise SystemExit(f"prompt {i}: output differs from plain decoding for {bad}")

    base = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    rows, cells = [], []
    for config in configs:
        cell = totals[config]
        tps = cell["tokens"] / cell["seconds"]
        verifies = cell.get("drafted_verifies", 0)
        tau = 1 + cell.get("accepted", 0) / verifies if verifies else float("nan")
        per_step = cell["propose_s"] / cell["steps"] * 1e6 if cell["steps"] else float("nan")
        drafted = cell.get("draft_tokens", 0)
        per_draft = cell["propose_s"] / drafted * 1e6 if drafted else float("nan")
        cells.append({"config": config, "tokens_per_s": tps, "vs_plain": tps / base, "tau": tau,
                      "propose_us_per_step": per_step, "propose_us_per_draft_token": per_draft, **cell})
        rows.append([config, f"{tps:.1f}", f"{tps / base:.3f}x", f"{tau:.2f}", f"{per_step:.0f}", f"{per_draft:.0f}"])
    print_table(["config", "tok/s", "÷ plain", "τ", "propose µs/step", "propose µs/draft token"], rows)
    out = {"machine": machine_info(args.threads), "args": vars(args), "prompts": len(prompts), "one_step": micro,
           "cells": cells}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
