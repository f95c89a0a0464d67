"""What speculation costs where no draft pays: plain decoding vs ``num_speculative_tokens="auto"``
with the controller's sleep capped at each of ``--max-sleep`` (0 = never sleeps), and a fixed k,
on one engine, in interleaved rounds (the order rotated per round).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benches/nothing_pays.py --workload "open chat" --batch 4 \
        --rounds 6 --max-tokens 96 [--max-sleep 0 3 7] [--k 2] [--json out.json]

Per configuration: tok/s and decode-phase tok/s (medians of rounds) and their ratio to plain; the
speculator's own time per engine step (its ``propose`` and ``commit``, ``benches.common.StepProfiler``)
and, for the auto ones, the steps its controller slept through (``AdaptiveSpecController.asleep``),
its probes and the draft tokens verified. Prompts and workloads are ``benches/adaptive.py``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.adaptive import WORKLOADS, prompt_texts  # noqa: E402
from benches.common import StepProfiler, engine_generate, machine_info, print_table, write_json  # noqa: E402
from benches.workloads import chat_token_ids  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="open chat", choices=list(WORKLOADS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-sleep", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--k", type=int, default=2, help="the fixed k run beside them (0: none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import tokenbudget.spec.adaptive as adaptive
    from tokenbudget import LLM
    from tokenbudget.api.spec_config import SpeculativeConfig
    from tokenbudget.engine.drafters.factory import build_speculator
    from tokenbudget.spec.speculator import Speculator

    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, max_model_len=1024 + args.max_tokens + 16,
              max_num_seqs=max(64, args.batch))
    engine = llm.engine

    def build(k):
        cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k})
        return build_speculator(cfg, engine.target, engine.scheduler, engine.runner)

    specs = {"plain": Speculator()}
    if args.k:
        specs[f"k={args.k}"] = build(args.k)
    sleep_cap = {}
    for cap in args.max_sleep:
        label = f"auto, sleep <= {cap}"
        specs[label] = build("auto")
        sleep_cap[label] = cap
    groups = max(1, 4 // args.batch)
    ids = [chat_token_ids(llm.tokenizer, t, 1024) for t in prompt_texts(args.workload, args.batch * groups)]
    labels = list(specs)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    default_cap = adaptive.MAX_SLEEP
    try:
        for rnd in range(args.rounds):
            for label in labels[rnd % len(labels):] + labels[:rnd % len(labels)]:
                adaptive.MAX_SLEEP = sleep_cap.get(label, default_cap)
                spec = engine.core.speculator = specs[label]
                ctrl = spec.controller
                before = None if ctrl is None else (ctrl.num_slept, ctrl.num_probes, spec.stats.num_draft_tokens)
                with StepProfiler(llm) as prof:
                    gs = [engine_generate(llm, ids[i:i + args.batch], args.max_tokens)
                          for i in range(0, len(ids), args.batch)]
                run = {"tok_s": sum(g.num_tokens for g in gs) / sum(g.total_s for g in gs),
                       "decode_tok_s": sum(g.num_tokens - len(g.token_ids) for g in gs) / sum(g.decode_s for g in gs),
                       "speculator_us": 1e6 * prof.seconds.get("speculate", 0.0) / max(prof.steps, 1),
                       "steps": prof.steps}
                if ctrl is not None:
                    run.update(slept=ctrl.num_slept - before[0], probes=ctrl.num_probes - before[1],
                               draft_tokens=spec.stats.num_draft_tokens - before[2])
                runs[label].append(run)
            print(f"round {rnd}: " + "  ".join(f"{lab}={runs[lab][-1]['tok_s']:.1f}" for lab in labels), flush=True)
    finally:
        adaptive.MAX_SLEEP = default_cap

    def med(label, key):
        return statistics.median(r[key] for r in runs[label])
    headers = ["config", "tok/s", "÷ plain", "decode tok/s", "decode ÷ plain", "speculator µs/step",
               "slept steps", "probes", "draft tokens"]
    rows = []
    for label in labels:
        extra = (["-"] * 3 if label not in sleep_cap else
                 [f"{med(label, 'slept'):.0f} of {med(label, 'steps'):.0f}", f"{med(label, 'probes'):.0f}",
                  f"{med(label, 'draft_tokens'):.0f}"])
        rows.append([label, f"{med(label, 'tok_s'):.1f}", f"{med(label, 'tok_s') / med('plain', 'tok_s'):.3f}",
                     f"{med(label, 'decode_tok_s'):.1f}",
                     f"{med(label, 'decode_tok_s') / med('plain', 'decode_tok_s'):.3f}",
                     f"{med(label, 'speculator_us'):.0f}"] + extra)
    print(f"{args.workload}, batch {args.batch}, {args.max_tokens} tokens, {args.rounds} rounds "
          f"(medians), {args.threads} thread(s), load {os.getloadavg()[0]:.1f}")
    print_table(headers, rows)
    result = {"args": vars(args), "machine": machine_info(args.threads), "runs": runs}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
