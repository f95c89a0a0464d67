"""A 900-token prefill and batch-1 decode steps on the CPU, in seconds / milliseconds (best of
repeats), for before/after runs of two checkouts alternated in separate processes:

    TOKENBUDGET_NATIVE=avx512_vnni python benches/prefill_decode.py --threads 1 --repeats 5

Uses only the public LLM API, so the same file runs against an older checkout's install. Prefill:
one request of ~900 prompt tokens, max_tokens=1, timed until it finishes (whole prefill, chunked as
the scheduler chunks it). Decode: a short prompt, 64 new tokens, EOS ignored, the steps after the
first.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-words", type=int, default=900)
    args = ap.parse_args(argv)
    from tokenbudget import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20)
    eng = llm.engine
    words = "the quick brown fox jumps over a lazy dog while seven bakers sing".split()
    long_prompt = " ".join(words[i % len(words)] + str(i % 7) for i in range(args.prompt_words // 2))

    def prefill() -> float:
        eng.add_request(f"p{time.perf_counter_ns()}", long_prompt, SamplingParams(max_tokens=1, temperature=0))
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - t

    def decode(n: int = 64) -> float:
        eng.add_request(f"d{time.perf_counter_ns()}", "Write a short story about a robot who learns to paint.",
                        SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))
        eng.step()
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return 1000 * (time.perf_counter() - t) / n

    tok = getattr(eng, "tokenizer", None)
    ntok = len(tok.encode(long_prompt)) if tok is not None else None
    prefill(), decode(8)  # warm-up
    pre = [prefill() for _ in range(args.repeats)]
    dec = [decode() for _ in range(args.repeats)]
    out = {"prompt_tokens": ntok, "prefill_s": min(pre), "decode_ms": min(dec), "prefill_all": pre, "decode_all": dec}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
