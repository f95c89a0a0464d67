"""The n-gram proposer's index (spec/ngram.py), measured: cost per request and step against the
numpy sliding-window reference, and the "recent" vs "earliest" match policy on a proxy.

    python benches/ngram_index.py                       # index vs reference, random repeated spans
    python benches/ngram_index.py --docs FILE.json      # + policy proxy on token lists (a JSON list)

Figures: benches/RESULTS.md, "n-gram index".
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import numpy as np

from tokenbudget.scheduler.request import Request
from tokenbudget.spec.ngram import NgramIndex, NgramProposer, ngram_propose_reference


def benchmark(seq_len: int = 2000, batch: int = 32, steps: int = 50, k: int = 4,
              vocab: int = 1000, seed: int = 0) -> dict[str, float]:
    """µs per request per step: incremental index (steady state, one new token per step) vs
    the numpy reference, on random tokens with repeated spans (so lookups hit)."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(batch):
        base = rng.integers(0, vocab, seq_len // 2).tolist()
        toks = base + base[: seq_len - len(base)]
        reqs.append(Request(f"b{i}", toks, max_tokens=10**9))
    prop = NgramProposer(2, 4, max_model_len=10**9)
    prop.propose(reqs, [k] * batch)  # initial (prefill-time) indexing
    new_tokens = rng.integers(0, vocab, (steps, batch)).tolist()
    elapsed = 0.0
    for step in range(steps):
        for r, t in zip(reqs, new_tokens[step]):
            r.all_token_ids.append(t)
        t0 = time.perf_counter()
        prop.propose(reqs, [k] * batch)
        elapsed += time.perf_counter() - t0
    t_index = elapsed / (steps * batch) * 1e6
    ref_steps = max(1, steps // 10)
    t0 = time.perf_counter()
    for _ in range(ref_steps):
        for r in reqs:
            ngram_propose_reference(r.all_token_ids, k, 2, 4)
    t_ref = (time.perf_counter() - t0) / (ref_steps * batch) * 1e6
    t0 = time.perf_counter()
    NgramProposer(2, 4, max_model_len=10**9).propose(reqs[:4], [k] * 4)
    t_build = (time.perf_counter() - t0) / 4 * 1e6
    return {"seq_len": seq_len, "batch": batch, "index_us_per_req_step": t_index,
            "reference_us_per_req_step": t_ref, "index_build_us_per_req": t_build}


def compare_policies(docs: Sequence[Sequence[int]], k: int = 4, min_n: int = 2,
                     max_n: int = 4) -> dict[str, dict[str, float]]:
    """Proxy acceptance of "recent" vs "earliest": for each doc, predict every position of its
    second half from its prefix and count how many drafted tokens match the real text
    (greedy acceptance: the matching prefix of the draft)."""
    result = {}
    for prefer in ("recent", "earliest"):
        drafted = accepted = steps = 0
        for doc in docs:
            idx = NgramIndex(min_n, max_n, prefer)
            doc = list(doc)
            pos = len(doc) // 2
            while pos < len(doc):
                idx.sync(doc[:pos])
                d = idx.lookup(min(k, len(doc) - pos))
                a = 0
                while a < len(d) and d[a] == doc[pos + a]:
                    a += 1
                drafted, accepted, steps = drafted + len(d), accepted + a, steps + 1
                pos += a + 1
        result[prefer] = {"acceptance_rate": accepted / max(drafted, 1),
                          "tokens_per_step": (accepted + steps) / max(steps, 1)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--docs", help="JSON list of token-id lists for the policy proxy")
    args = ap.parse_args()
    print(json.dumps(benchmark(args.seq_len, args.batch), indent=1))
    if args.docs:
        with open(args.docs) as f:
            print(json.dumps(compare_policies(json.load(f)), indent=1))


if __name__ == "__main__":
    main()
