"""Engine step time by the verify rows it carries, at a fixed batch: plain decoding, then n-gram
drafts (k = 2), the same B prompts, greedy. Each committed step whose B requests are all decoding
is binned by its rows beyond B (the drafts verified); the median step time per bin shows what a
draft row costs at that batch and thread count (the draft-length controller prices it).

    PYTHONPATH=. OMP_NUM_THREADS=2 python benches/step_by_rows.py --workload "open chat" --batch 64 --threads 2
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.adaptive import WORKLOADS, prompt_texts  # noqa: E402
from benches.common import engine_generate, write_json  # noqa: E402
from benches.workloads import chat_token_ids  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="open chat", choices=list(WORKLOADS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from tokenbudget import LLM
    from tokenbudget.api.spec_config import SpeculativeConfig
    from tokenbudget.engine.drafters.factory import build_speculator
    from tokenbudget.spec.speculator import Speculator
    from tokenbudget.spec.step_shape import step_shape

    b = args.batch
    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, max_model_len=1024 + args.max_tokens + 32,
              max_num_seqs=b)
    eng = llm.engine
    ids = [chat_token_ids(llm.tokenizer, t, 1024) for t in prompt_texts(args.workload, b)]
    out = {}
    for label, cfg in (("plain", None), ("ngram k=2", {"method": "ngram", "num_speculative_tokens": 2})):
        sp = Speculator() if cfg is None else build_speculator(
            SpeculativeConfig.from_dict(cfg), eng.target, eng.scheduler, eng.runner)
        bins: dict[int, list[float]] = collections.defaultdict(list)
        commit = sp.commit

        def timed_commit(plan, sched=None, step_seconds=None, aux_hidden_states=None, commit=commit, bins=bins):
            if sched is not None and step_seconds is not None:
                shape = step_shape(sched)
                if shape.requests == b and shape.tokens <= 4 * b:   # all B decoding: no prefill chunk
                    bins[shape.tokens - b].append(step_seconds)
            return commit(plan, sched, step_seconds, aux_hidden_states)
        sp.commit = timed_commit
        eng.core.speculator = sp
        t0 = time.perf_counter()
        g = engine_generate(llm, ids, args.max_tokens)
        wall = time.perf_counter() - t0
        out[label] = {"tok_s": g.num_tokens / wall,
                      "steps_ms": {k: (len(v), statistics.median(v) * 1e3) for k, v in sorted(bins.items())}}
        print(f"{label:>10}: {g.num_tokens / wall:7.1f} tok/s; median step ms by verify rows:",
              ", ".join(f"+{k}: {ms:.1f} ({n})" for k, (n, ms) in out[label]["steps_ms"].items()), flush=True)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
