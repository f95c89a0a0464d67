"""Acceptance by draft kind: how well a free drafter's own label predicts its draft's fate.

The n-gram and suffix drafters label each draft (``spec.proposer``: the matched suffix's length,
in classes for suffix decoding), and the draft-length controller keeps one acceptance estimate
per label (``spec.adaptive``). This measures why: greedy plain outputs of the default model on
the adaptive sweep's workloads, then, at every output position, the draft each drafter would
propose there (k = 4) and how many of its tokens the target's own continuation confirms (under
greedy verification exactly the accepted count). Offline, so every position is scored, not only
those a run happens to draft at.

    PYTHONPATH=. python benches/draft_kinds.py --json benches/results/draft_kinds.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benches.adaptive import WORKLOADS, prompt_texts  # noqa: E402
from benches.common import engine_generate, print_table, write_json  # noqa: E402
from benches.workloads import chat_token_ids  # noqa: E402


def score(proposer, prompt: list[int], output: list[int], k: int, stats: dict) -> None:
    """Every position of ``output``: ``proposer``'s draft there, its kind, the tokens confirmed."""
    from tokenbudget.scheduler.request import Request

    req = Request("r", list(prompt), max_tokens=10**6)
    for t in range(len(output) - 1):
        req.all_token_ids = list(prompt) + list(output[:t + 1])
        proposal = proposer.propose([req], [k])
        (draft,), (kind,) = proposal.token_ids, proposal.kinds
        if not draft:
            continue
        truth = output[t + 1:t + 1 + len(draft)]
        n = 0
        while n < len(truth) and draft[n] == truth[n]:
            n += 1
        s = stats[kind]
        s[0] += 1
        s[1] += n > 0
        s[2] += n
    for table in proposer.tables:  # the engine's release path
        table.drop(req.request_id)
    proposer.on_finished(req)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from tokenbudget import LLM
    from tokenbudget.spec.ngram import NgramProposer
    from tokenbudget.spec.suffix import SuffixProposer

    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, max_model_len=1024 + args.max_tokens + 16,
              max_num_seqs=args.prompts)
    rows, result = [], {"argv": sys.argv[1:], "workloads": {}}
    for workload in WORKLOADS:
        ids = [chat_token_ids(llm.tokenizer, t, 1024) for t in prompt_texts(workload, args.prompts)]
        outs = engine_generate(llm, ids, args.max_tokens).token_ids
        for name, make in (("ngram", lambda: NgramProposer(2, 4, max_model_len=10**6)),
                           ("suffix", lambda: SuffixProposer(max_model_len=10**6))):
            stats: dict = collections.defaultdict(lambda: [0, 0, 0])
            proposer = make()
            for p, o in zip(ids, outs):
                score(proposer, p, o, args.k, stats)
            per = {}
            for kind in sorted(stats):
                n, first, acc = stats[kind]
                per[kind] = {"drafts": n, "first_accepted": first / n, "mean_accepted": acc / n}
                rows.append([workload, name, kind, n, f"{first / n:.2f}", f"{acc / n:.2f}"])
            result["workloads"].setdefault(workload, {})[name] = per
    print_table(["workload", "drafter", "kind (match length)", "drafts", "first accepted",
                 f"mean accepted (k = {args.k})"], rows)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
