"""What a smaller draft lm head costs the shipped EAGLE-3 head in held-out acceptance: its lm head
int8 (what the engine runs) or int4, its draft vocabulary cut to the N most frequent ids of the
training responses, on the held-out chains of a ``train-draft`` work dir.

    PYTHONPATH=. OMP_NUM_THREADS=2 python benches/eagle3_lm_head.py --work-dir W --vocab 4096 3072 2048 \\
        --lm-head int8 int4 [--json out.json]

The lm head is more than half of the bytes a draft step reads (4096 x 576: 2.36 MB in int8, the
rest of the layer 1.7 MB in int4), and a draft step at batch 1 costs about its bytes read from
memory (benches/RESULTS.md). Each variant is the head quantized as the engine quantizes it on the
default model (``quantize_head``: int4 linears), with the lm head in the given mode, evaluated by
``training.evaluate.acceptance`` (greedy, k = 4) on the work dir's held-out tap states. Reports τ
overall and per kind, and the lm head's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.common import machine_info, print_table, write_json  # noqa: E402


def cut_vocab(head, keep_target_ids):
    """A copy of ``head`` whose draft vocabulary is ``keep_target_ids`` (a subset of its own): the
    lm head keeps those rows."""
    import dataclasses

    import torch

    from tokenbudget.engine.model.eagle3 import Eagle3Head

    keep = torch.as_tensor(keep_target_ids, dtype=torch.int64).sort().values
    own = head.to_target_ids(torch.arange(head.config.draft_vocab_size))
    rows = torch.searchsorted(own, keep)
    if not torch.equal(own[rows], keep):
        raise ValueError("keep_target_ids must be inside the head's draft vocabulary")
    out = Eagle3Head(dataclasses.replace(head.config, draft_vocab_size=keep.numel()))
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    out.load_state_dict(state, strict=False)
    with torch.no_grad():
        out.lm_head.weight.copy_(head.lm_head.weight[rows])
    out.set_draft_vocab(keep)
    return out.eval()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", required=True, help="a train-draft work dir (features/heldout_*.pt, responses.json)")
    ap.add_argument("--head", default=None, help="head directory (default: the shipped head)")
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096, 3072, 2048])
    ap.add_argument("--lm-head", nargs="+", default=["int8", "int4"], choices=["int8", "int4", "float"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from tokenbudget.engine.drafters.eagle3_build import shipped_head_dir
    from tokenbudget.engine.model.eagle3 import load_eagle3
    from tokenbudget.engine.model.eagle3_cpu import quantize_head
    from tokenbudget.training.evaluate import acceptance
    from tokenbudget.training.features import FeatureSet

    torch.set_num_threads(args.threads)
    w = args.work_dir
    shards = sorted(n for n in os.listdir(os.path.join(w, "features")) if n.startswith("heldout_"))
    fs = FeatureSet.concat([FeatureSet.load(os.path.join(w, "features", n)) for n in shards])
    embed = torch.load(os.path.join(w, "embed.pt"), weights_only=True)
    with open(os.path.join(w, "responses.json")) as f:
        train = json.load(f)["train"]
    head0 = load_eagle3(args.head or shipped_head_dir(), num_target_layers=30)
    counts = torch.zeros(head0.config.vocab_size, dtype=torch.int64)
    for conv in train:
        counts += torch.bincount(torch.as_tensor(conv["response_ids"], dtype=torch.int64),
                                 minlength=head0.config.vocab_size)
    own = head0.to_target_ids(torch.arange(head0.config.draft_vocab_size))
    by_freq = own[torch.argsort(counts[own], descending=True, stable=True)]
    total = int(counts.sum())

    rows, cells = [], []
    for n in args.vocab:
        keep = by_freq[:n]
        coverage = int(counts[keep].sum()) / total
        for mode in args.lm_head:
            head = cut_vocab(head0, keep)
            if mode != "float":
                quantize_head(head, "int4", lm_head_mode=mode)
                q = head.lm_head.quant
                nbytes = (q.native.packed if q.native is not None else q.packed).numel()
            else:
                nbytes = head.lm_head.weight.numel() * 4
            res = acceptance(head, embed, fs, 4)
            kinds = {k: v["tau"] for k, v in res.items() if k != "all" and v.get("chains")}
            cells.append({"draft_vocab": n, "lm_head": mode, "lm_head_bytes": nbytes, "train_coverage": coverage,
                          "tau": res["all"]["tau"], "accept_at_position": res["all"]["accept_at_position"],
                          "tau_by_kind": kinds})
            rows.append([n, mode, f"{nbytes / 1e6:.2f}", f"{coverage:.3f}", f"{res['all']['tau']:.3f}",
                         " / ".join(f"{a:.2f}" for a in res["all"]["accept_at_position"]),
                         f"{kinds.get('chat', float('nan')):.2f}", f"{kinds.get('writing', float('nan')):.2f}"])
            print_table(["draft vocab", "lm head", "MB", "train coverage", "τ", "accept@1..4", "chat τ",
                         "writing τ"], rows[-1:])
    print()
    print_table(["draft vocab", "lm head", "MB", "train coverage", "τ", "accept@1..4", "chat τ", "writing τ"], rows)
    out = {"machine": machine_info(args.threads), "args": vars(args), "cells": cells}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
