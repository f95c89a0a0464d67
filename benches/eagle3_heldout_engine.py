"""A head's acceptance in the engine on the held-out prompts of a ``train-draft`` work dir, beside
what ``train-draft`` reports offline for the same prompts (``eval.json``).

    PYTHONPATH=. OMP_NUM_THREADS=2 python benches/eagle3_heldout_engine.py --work-dir W [--head DIR] \\
        [--k 4] [--threads 2] [--json out.json]

Offline, every position of a held-out response starts a draft chain. In the engine a chain starts
only where the last verify ended, which is more often right after a rejected draft: a position the
head just got wrong, so in-engine τ reads lower than the offline figure on the same text. Greedy,
batch 1, fixed k, the default model as the engine loads it; ``--head`` defaults to the shipped
head. Prints τ and the acceptance of draft 1 per kind, in the engine and offline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.common import machine_info, print_table, write_json  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--head", default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192, help="as train-draft's responses")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from tokenbudget import LLM, SamplingParams

    with open(os.path.join(args.work_dir, "prompts.json")) as f:
        heldout = json.load(f)["heldout"]
    offline = {}
    eval_path = os.path.join(args.work_dir, "eval.json")
    if os.path.exists(eval_path) and args.head is None:
        with open(eval_path) as f:
            offline = json.load(f)
    spec = {"method": "eagle3", "num_speculative_tokens": args.k}
    if args.head is not None:
        spec["model"] = args.head
    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    counts: dict[str, list[int]] = {}
    for kind, text in heldout:
        s0 = llm.get_spec_stats()
        before = (s0.num_drafts, s0.num_accepted_tokens, s0.drafted_per_pos[:1], s0.accepted_per_pos[:1])
        llm.generate([llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])], params,
                     use_tqdm=False)
        s1 = llm.get_spec_stats()
        c = counts.setdefault(kind, [0, 0, 0, 0])
        c[0] += s1.num_drafts - before[0]
        c[1] += s1.num_accepted_tokens - before[1]
        c[2] += (s1.drafted_per_pos[:1] or [0])[0] - (before[2] or [0])[0]
        c[3] += (s1.accepted_per_pos[:1] or [0])[0] - (before[3] or [0])[0]
    rows, cells = [], []
    total = [sum(c[i] for c in counts.values()) for i in range(4)]
    for kind, c in [*sorted(counts.items()), ("all", total)]:
        tau = 1 + c[1] / c[0] if c[0] else float("nan")
        a1 = c[3] / c[2] if c[2] else float("nan")
        off = offline.get(kind, {})
        off_tau, off_a1 = off.get("tau", float("nan")), (off.get("accept_at_position") or [float("nan")])[0]
        cells.append({"kind": kind, "tau": tau, "accept_1": a1, "offline_tau": off_tau, "offline_accept_1": off_a1})
        rows.append([kind, f"{tau:.2f}", f"{a1:.2f}", f"{off_tau:.2f}", f"{off_a1:.2f}"])
    print_table(["kind", "engine τ", "engine accept@1", "offline τ", "offline accept@1"], rows)
    out = {"machine": machine_info(args.threads), "args": vars(args), "cells": cells}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
