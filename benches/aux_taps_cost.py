"""What EAGLE-3's taps cost the target: batch-1 greedy decode tokens/s of the default model with
``set_aux_layers`` off and on (the three default layers, ``engine/model/aux_states.py``).

Same engine, same prompts, the runs interleaved repeat by repeat (off, on, off, on, ...) so machine
noise hits both; medians of decode tokens/s (from the first generated token to the last, EOS
ignored so every run decodes exactly ``--max-new-tokens``). Then the forward alone (one decode
row at context 200, ``--forward-iters`` calls per sample, samples interleaved off/on): median and
minimum milliseconds, the figure that noise on a shared machine blurs least.

    PYTHONPATH=. python benches/aux_taps_cost.py --threads 2 --max-new-tokens 128 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benches.common import engine_generate, machine_info, median  # noqa: E402
from benches.workloads import chat_token_ids, spec_bench  # noqa: E402


def forward_ms(runner, taps, iters: int, samples: int = 30) -> dict:
    """The model's forward alone for one decode row at context 200 (block table of the pool's
    first blocks; the engine is idle), taps off vs on, samples interleaved."""
    from tokenbudget.scheduler.output import ScheduledRequest, SchedulerOutput

    def step(start, ids):
        sr = ScheduledRequest(request_id="bench", num_computed_tokens=start, token_ids=ids, spec_token_ids=[],
                              block_ids=list(range(-(-201 // runner.block_size))), is_new=start == 0,
                              needs_sample=False)
        return runner.prepare_inputs(SchedulerOutput([sr], total_num_scheduled_tokens=len(ids)))[:3]

    model, kv = runner.model, runner.kv_caches
    model(*step(0, list(range(1, 201))), kv)
    decode = step(200, [5])
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(samples):
        for mode in ("off", "on"):
            runner.set_aux_layers(taps if mode == "on" else None)
            t0 = time.perf_counter()
            for _ in range(iters):
                model(*decode, kv)
            times[mode].append((time.perf_counter() - t0) / iters * 1e3)
    return {f"forward_ms_{mode}_{stat}": round(f(v), 4) for mode, v in times.items()
            for stat, f in (("median", median), ("min", min))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--forward-iters", type=int, default=50)
    ap.add_argument("--quantization", default="auto", help="auto (the default model's int4, C forward) | int8 | none")
    args = ap.parse_args(argv)

    from tokenbudget import LLM
    from tokenbudget.engine.model.cpu_forward import kernels_summary
    from tokenbudget.engine.model.eagle3 import default_aux_layer_ids

    torch.set_num_threads(args.threads)
    llm = LLM(num_threads=args.threads, enable_prefix_caching=False, quantization=args.quantization)
    runner = llm.engine.core.runner
    taps = default_aux_layer_ids(llm.engine.core.runner.config.num_hidden_layers)
    prompts = [chat_token_ids(llm.tokenizer, p.text, 256) for p in spec_bench(1, ("writing", "qa"))]
    engine_generate(llm, prompts[:1], 8, ignore_eos=True)  # warm-up
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            runner.set_aux_layers(taps if mode == "on" else None)
            for p in prompts:
                t = engine_generate(llm, [p], args.max_new_tokens, ignore_eos=True)
                rates[mode].append((len(t.token_ids[0]) - 1) / (t.total_s - t.ttft_s))
    forward = forward_ms(runner, taps, args.forward_iters)
    runner.set_aux_layers(None)
    off, on = median(rates["off"]), median(rates["on"])
    result = {"machine": machine_info(args.threads), "kernels": kernels_summary(runner.model), "taps": taps,
              "decode_tok_s_off": off, "decode_tok_s_on": on, "ratio_on_off": on / off,
              "runs_per_mode": len(rates["on"]), **forward, "loadavg_at_end": os.getloadavg()}
    print(result)
    return result


if __name__ == "__main__":
    main()
