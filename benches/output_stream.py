"""One long stream: is the per-step cost of outputs flat in the output's length?

A single request generates ``--tokens`` tokens (EOS ignored) through the real ``EngineCore``,
scheduler, KV cache, ``OutputProcessor`` and incremental detokenizer (the default model's
tokenizer); only the model is a stand-in (``testing.FakeModelRunner``: next token = a
hash of the prefix, ids within the first 64 of the vocabulary), so the time measured is the
engine's, not a forward pass. It is run once per ``output_kind`` and the step time is reported
per bucket of output length: flat for ``DELTA`` and ``FINAL_ONLY`` (O(new tokens) per step);
``CUMULATIVE`` hands out the whole token list every step by definition (as vLLM's does) and
grows with it. A second table reads an ``AsyncLLM``-style ``RequestStream`` that nobody reads
until the end: the pending pieces coalesce, so its memory is the request's own text and ids.

    python benches/output_stream.py [--tokens 4000] [--bucket 500] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from tokenbudget.engine.core.engine_core import EngineCore  # noqa: E402
from tokenbudget.engine.core.output_processor import OutputProcessor  # noqa: E402
from tokenbudget.engine.entrypoints.stream import RequestStream  # noqa: E402
from tokenbudget.scheduler.config import SchedulerConfig  # noqa: E402
from tokenbudget.scheduler.request import Request  # noqa: E402
from tokenbudget.scheduler.scheduler import Scheduler  # noqa: E402
from tokenbudget.testing.fake_model import FakeModelRunner, FakeModelSpec  # noqa: E402

PROMPT = [1, 17, 42, 5, 9, 33, 12, 7]


def load_tokenizer():

    from tokenbudget.engine.loader import default_model
    from tokenbudget.engine.loader.gguf_loader import read_gguf_metadata
    from tokenbudget.engine.text.gguf_tokenizer import build_gguf_tokenizer
    return build_gguf_tokenizer(read_gguf_metadata(default_model.default_model_path()))


def build_core(tokenizer, num_tokens: int) -> EngineCore:
    block_size = 16
    max_len = len(PROMPT) + num_tokens + 1
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=max_len,
                             block_size=block_size, num_blocks=-(-max_len // block_size) + 2)
    runner = FakeModelRunner(FakeModelSpec(), config.num_blocks, block_size)
    return EngineCore(Scheduler(config), runner, None, OutputProcessor(tokenizer))


def run_kind(tokenizer, kind: RequestOutputKind, num_tokens: int, bucket: int) -> dict:
    core = build_core(tokenizer, num_tokens)
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True, output_kind=kind)
    core.add_request(Request("long", list(PROMPT), max_tokens=num_tokens, ignore_eos=True, eos_token_id=0,
                             sampling_params=params), None)
    times: dict[int, list[float]] = {}
    produced = 0
    clock = time.thread_time
    while core.has_unfinished_requests():
        t0 = clock()
        outs = core.step()
        dt = clock() - t0
        if produced:  # the first step is the prefill
            times.setdefault(produced // bucket, []).append(dt)
        for out in outs:
            produced = len(out.outputs[0].token_ids) if kind == RequestOutputKind.CUMULATIVE else produced + (
                len(out.outputs[0].token_ids) if kind == RequestOutputKind.DELTA else 0)
        if kind == RequestOutputKind.FINAL_ONLY:
            produced = len(core.scheduler.requests["long"].all_token_ids) - len(PROMPT) \
                if "long" in core.scheduler.requests else num_tokens
    return {b: 1e6 * sum(v) / len(v) for b, v in sorted(times.items())}


def unread_stream_memory(num_tokens: int) -> dict:
    """Put ``num_tokens`` one-token DELTA outputs into a stream nobody reads; its traced memory."""
    from tokenbudget.api.outputs import CompletionOutput, RequestOutput

    async def main() -> dict:
        stream = RequestStream("unread", RequestOutputKind.CUMULATIVE, lambda rid: None)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(num_tokens):
            stream.put(RequestOutput(request_id="unread", prompt=None, prompt_token_ids=PROMPT,
                                     outputs=[CompletionOutput(text="ab", token_ids=[i % 50_000])],
                                     finished=i == num_tokens - 1))
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        outs = [o async for o in stream]
        return {"tokens": num_tokens, "held_bytes": held, "outputs_read": len(outs),
                "final_tokens": len(outs[-1].outputs[0].token_ids)}

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--bucket", type=int, default=500)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    kinds = [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE]
    table = {k.name: run_kind(tokenizer, k, args.tokens, args.bucket) for k in kinds}
    buckets = sorted({b for t in table.values() for b in t})
    print(f"engine step time (µs, thread CPU clock) by output length, one request, {args.tokens} tokens")
    print("output tokens  " + "  ".join(f"{k.name:>11}" for k in kinds))
    for b in buckets:
        row = "  ".join(f"{table[k.name].get(b, float('nan')):11.1f}" for k in kinds)
        print(f"{b * args.bucket:>5}-{(b + 1) * args.bucket - 1:<7}  {row}")
    mem = [unread_stream_memory(n) for n in (1000, 4000, 16000)]
    print("\nunread CUMULATIVE stream (one output per token, nobody reading until the end)")
    print("tokens  held bytes  bytes/token  outputs read  final token ids")
    for m in mem:
        print(f"{m['tokens']:>6}  {m['held_bytes']:>10}  {m['held_bytes'] / m['tokens']:>11.1f}  "
              f"{m['outputs_read']:>12}  {m['final_tokens']:>15}")
    if args.json:
        args.json.write_text(json.dumps({"step_us": table, "bucket": args.bucket, "unread_stream": mem}, indent=1))


if __name__ == "__main__":
    main()
