"""What the EAGLE-3 drafter's catch-up over a prompt costs: the head run over N queued rows of
target states with the output of the last row only (``Eagle3Head.forward(out_rows=...)``, what
the drafter does) against every row's output (what it did before), interleaved in rounds.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benches/eagle3_catchup.py --rows 16 256 1500 --threads 1 [--json out.json]

The head is the shipped one on the default model, quantized as the engine quantizes it (its
linears int4 on the C kernels where they run); the states are random (the cost does not depend
on them). Reports the median milliseconds per catch-up of each way and their ratio, and checks
that the last row's logits agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.common import machine_info, print_table, write_json  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 256, 1500])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from tokenbudget import LLM
    from tokenbudget.engine.drafters.eagle3_kv import HeadState, segment_attend

    llm = LLM(num_threads=args.threads, speculative_config={"method": "eagle3", "num_speculative_tokens": 1})
    prop = llm.engine.speculator.proposer
    head, c = prop.head, prop.head.config
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)

    def catch_up(n: int, last_only: bool, aux, ids) -> torch.Tensor:
        st = HeadState.empty(c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
        st.reserve(n)
        with torch.inference_mode():
            emb, fused, pos = prop.embed[ids], head.fuse(aux), torch.arange(n)
            if last_only:
                _, logits = head(emb, fused, pos, segment_attend([(st, 0, n)], last_only=True),
                                 out_rows=torch.tensor([n - 1]))
                return logits[0]
            _, logits = head(emb, fused, pos, segment_attend([(st, 0, n)]))
            return logits[-1]

    rows, cells = [], []
    for n in args.rows:
        aux = torch.randn(n, 3 * c.target_hidden_size, generator=gen) * 4
        ids = torch.randint(0, c.vocab_size, (n,), generator=gen)
        times = {True: [], False: []}
        for r in range(args.rounds):
            for last_only in ((True, False) if r % 2 else (False, True)):
                t = time.perf_counter()
                catch_up(n, last_only, aux, ids)
                times[last_only].append(time.perf_counter() - t)
        diff = float((catch_up(n, True, aux, ids) - catch_up(n, False, aux, ids)).abs().max())
        last, every = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        cells.append({"rows": n, "last_row_ms": last, "every_row_ms": every, "max_logit_diff": diff})
        rows.append([n, f"{every:.2f}", f"{last:.2f}", f"{every / last:.1f}x", f"{diff:.1e}"])
    print_table(["rows", "every row's output ms", "last row's only ms", "saving", "max |logit diff|"], rows)
    out = {"machine": machine_info(args.threads), "args": vars(args), "cells": cells}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
