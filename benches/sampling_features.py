"""What vLLM-style sampling features cost: row preparation alone, then end to end.

1. ``prepare_logits`` on random [B * (1 + k), V] logits (V = 49152, the default model's), for
   B requests with k drafts each and L committed output tokens: per call and per row, for plain
   rows (nothing to do), penalties, penalties + logit bias + bad words, and a Python logits
   processor.
2. The default model, greedy, batch of chat prompts: decode tokens/s with no feature, with
   penalties + logit bias + bad words, each without speculation and with n-gram speculation;
   runs interleaved repeat by repeat, medians reported. The outputs with and without n-gram
   must be identical (asserted).

    PYTHONPATH=. python benches/sampling_features.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tokenbudget import LLM, SamplingParams  # noqa: E402
from tokenbudget.engine.worker.logits_processing import prepare_logits  # noqa: E402
from tokenbudget.engine.worker.sampler import SamplingRow  # noqa: E402

FEATURES = {
    "none": {},
    "penalties": dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3),
    "penalties+bias+bad_words": dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3,
                                     logit_bias={28: 1.0, 29: -1.0, 30: 2.0}),
    "logits_processor": dict(logits_processors=[lambda ids, row: row]),
}
BAD_WORDS = ((2654, 4461), (803,), (1003, 253))


def micro(batch: int, k: int, out_len: int, repeats: int) -> list[tuple]:
    vocab = 49152
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch * (1 + k), vocab, generator=g)
    output = torch.randint(0, vocab, (out_len,), generator=g).tolist()
    prompt = torch.randint(0, vocab, (200,), generator=g).tolist()
    drafts = torch.randint(0, vocab, (k,), generator=g).tolist()
    rows_out = []
    for name, kw in FEATURES.items():
        params = SamplingParams(temperature=0.0, **kw)
        words = BAD_WORDS if "bad_words" in name else ()
        rows = [SamplingRow(params, 0, 200 + out_len, list(drafts), None, out_len, (), prompt, output, words)
                for _ in range(batch)]
        prepare_logits(logits, rows)
        times = []
        for _ in range(repeats * 5):
            t = time.perf_counter()
            prepare_logits(logits, rows)
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        rows_out.append((name, batch, k, out_len, ms, ms * 1e3 / (batch * (1 + k))))
    return rows_out


def end_to_end(threads: int, repeats: int, max_tokens: int) -> list[tuple]:
    from benches.workloads import chat_token_ids, code_editing, spec_bench
    engines = {"off": LLM(num_threads=threads, max_model_len=1024),
               "ngram": LLM(num_threads=threads, max_model_len=1024,
                            speculative_config={"method": "ngram", "num_speculative_tokens": 4})}
    tok = engines["off"].tokenizer
    prompts = [chat_token_ids(tok, q.text) for q in code_editing(4) + spec_bench(per_category=1)[:4]]
    kinds = {"none": {}, "penalties+bias+bad_words": dict(FEATURES["penalties+bias+bad_words"],
                                                          bad_words=[" however", "Note"])}
    times: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], list] = {}
    for _ in range(repeats):
        for kind, kw in kinds.items():
            for spec, llm in engines.items():
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                times.setdefault((kind, spec), []).append(time.perf_counter() - t)
                tokens[(kind, spec)] = [o.outputs[0].token_ids for o in outs]
    for kind in kinds:
        assert tokens[(kind, "off")] == tokens[(kind, "ngram")], f"{kind}: n-gram changed the output"
    n = len(prompts) * max_tokens
    return [(kind, spec, n / statistics.median(ts)) for (kind, spec), ts in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("prepare_logits (V = 49152, CPU):")
    print(f"{'feature':>26} {'B':>3} {'k':>2} {'L':>5} {'ms/call':>8} {'us/row':>7}")
    for b, k, length in ((8, 0, 256), (8, 4, 256), (32, 4, 1024)):
        for name, b_, k_, l_, ms, us in micro(b, k, length, args.repeats):
            print(f"{name:>26} {b_:>3} {k_:>2} {l_:>5} {ms:>8.2f} {us:>7.1f}")
    if args.skip_e2e:
        return
    print(f"\nend to end, default model, 8 chat prompts (4 code edits, 4 Spec-Bench) x {args.max_tokens} tokens, "
          "greedy (tokens/s, median):")
    for kind, spec, tps in end_to_end(args.threads, args.repeats, args.max_tokens):
        print(f"{kind:>26} spec={spec:<6} {tps:8.1f}")


if __name__ == "__main__":
    main()
