"""What speculation costs where no draft pays: plain decoding vs ``num_speculative_tokens="auto"``
with the controller's sleep capped at each of ``--max-sleep`` (0 = never sleeps), and a fixed k,
on one engine, in interleaved rounds (the order rotated per round).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benches/nothing_pays.py --workload "open chat" --batch 4 \
        --rounds 6 --max-tokens 96 [--max-sleep 0 3 7] [--k 2] [--json out.json]

Per configuration: tok/s and decode-phase tok/s (medians of rounds) and their ratio to plain; for
the auto ones, the speculator's own time per engine step (its ``propose`` and ``commit``, timed
around the calls), the steps it slept through (``AdaptiveSpecController.asleep``), its probes and
the draft tokens it verified. Prompts and workloads are ``benches/adaptive.py``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.adaptive import WORKLOADS, prompt_texts  # noqa: E402
from benches.common import engine_generate, machine_info, print_table, write_json  # noqa: E402
from benches.workloads import chat_token_ids  # noqa: E402


class _Timed:
    """Seconds spent in ``propose`` / ``commit`` of a speculator and the steps its controller slept."""

    def __init__(self, spec) -> None:
        self.seconds = {"propose": 0.0, "commit": 0.0}
        self.steps = self.slept = 0
        for name in self.seconds:
            setattr(spec, name, self._timed(name, getattr(spec, name)))
        asleep = spec.controller.asleep

        def counted(requests):
            out = asleep(requests)
            self.slept += out
            return out
        spec.controller.asleep = counted

    def _timed(self, name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.steps += name == "propose"
        return call

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.steps = self.slept = 0


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
    from tokenbudget.engine.core.wiring import _build_speculator
    from tokenbudget.spec.speculator import Speculator

    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, max_model_len=1024 + args.max_tokens + 16,
              max_num_seqs=max(64, args.batch))
    engine = llm.engine

    def build(k):
        cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k})
        return _build_speculator(cfg, engine.target, engine.scheduler, engine.runner)

    specs = {"plain": Speculator()}
    if args.k:
        specs[f"k={args.k}"] = build(args.k)
    timers, sleep_cap = {}, {}
    for cap in args.max_sleep:
        label = f"auto, sleep <= {cap}"
        specs[label] = build("auto")
        timers[label], sleep_cap[label] = _Timed(specs[label]), cap
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
                timer = timers.get(label)
                if timer is not None:
                    timer.reset()
                    probes0, drafts0 = spec.controller.num_probes, spec.stats.num_draft_tokens
                gs = [engine_generate(llm, ids[i:i + args.batch], args.max_tokens)
                      for i in range(0, len(ids), args.batch)]
                run = {"tok_s": sum(g.num_tokens for g in gs) / sum(g.total_s for g in gs),
                       "decode_tok_s": sum(g.num_tokens - len(g.token_ids) for g in gs) / sum(g.decode_s for g in gs)}
                if timer is not None:
                    n = max(timer.steps, 1)
                    run.update(propose_us=1e6 * timer.seconds["propose"] / n,
                               commit_us=1e6 * timer.seconds["commit"] / n, steps=timer.steps,
                               slept=timer.slept, probes=spec.controller.num_probes - probes0,
                               draft_tokens=spec.stats.num_draft_tokens - drafts0)
                runs[label].append(run)
            print(f"round {rnd}: " + "  ".join(f"{lab}={runs[lab][-1]['tok_s']:.1f}" for lab in labels), flush=True)
    finally:
        adaptive.MAX_SLEEP = default_cap

    def med(label, key):
        return statistics.median(r[key] for r in runs[label])
    headers = ["config", "tok/s", "÷ plain", "decode tok/s", "decode ÷ plain", "propose µs/step", "commit µs/step",
               "slept steps", "probes", "draft tokens"]
    rows = []
    for label in labels:
        extra = (["-"] * 5 if label not in timers else
                 [f"{med(label, 'propose_us'):.0f}", f"{med(label, 'commit_us'):.0f}",
                  f"{med(label, 'slept'):.0f} of {med(label, 'steps'):.0f}", f"{med(label, 'probes'):.0f}",
                  f"{med(label, 'draft_tokens'):.0f}"])
        rows.append([label, f"{med(label, 'tok_s'):.1f}", f"{med(label, 'tok_s') / med('plain', 'tok_s'):.3f}",
                     f"{med(label, 'decode_tok_s'):.1f}",
                     f"{med(label, 'decode_tok_s') / med('plain', 'decode_tok_s'):.3f}"] + extra)
    print(f"{args.workload}, batch {args.batch}, {args.max_tokens} tokens, {args.rounds} rounds "
          f"(medians), {args.threads} thread(s), load {os.getloadavg()[0]:.1f}")
    print_table(headers, rows)
    result = {"args": vars(args), "machine": machine_info(args.threads), "runs": runs}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
