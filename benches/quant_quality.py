"""Quality and speed of each ``quantization`` mode on the default model (CPU, fp32 activations
outside the GEMMs).

Per mode (none / int8 / int4): perplexity of the model on a held text (Spec-Bench writing, humanities and
stem questions not used as prompts, joined and cut to ``--ppl-tokens`` tokens, one whole-sequence
forward);
greedy agreement with the fp32 (``none``) path: over ``--prompts`` chat-templated Spec-Bench
prompts, the fraction of prompts whose ``--max-new-tokens`` greedy tokens are identical and the
mean length of the common prefix; decode tok/s at batch 1 for each thread count (median over the
prompts, prefill excluded), the modes interleaved prompt by prompt so machine noise hits all.

    PYTHONPATH=. python benches/quant_quality.py [--threads 1 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benches.common import engine_generate, machine_info, median, print_table, write_json
from benches.workloads import chat_token_ids, spec_bench

MODES = ("none", "int8", "int4")


def load(mode: str):
    from tokenbudget.engine.loader.target import load_target_model
    return load_target_model(None, dtype="float32", device="cpu", quantization=mode)


@torch.inference_mode()
def perplexity(target, ids: list[int]) -> float:
    """exp(mean NLL of ids[1:]) from one prefill forward over a fresh KV cache."""
    from tokenbudget.engine.worker.kv_cache_alloc import allocate_kv_caches
    from tokenbudget.engine.worker.model_runner import ModelRunner
    from tokenbudget.scheduler.output import ScheduledRequest, SchedulerOutput
    from tokenbudget.scheduler.request import Request

    block = 16
    nb = -(-len(ids) // block)
    runner = ModelRunner(target.model, target.config,
                         allocate_kv_caches(target.config, nb, block, torch.float32, "cpu"), block, sampler=None)
    req = Request("ppl", ids)
    sched = SchedulerOutput()
    sched.scheduled.append(ScheduledRequest(request_id="ppl", num_computed_tokens=0, token_ids=list(ids),
                                            spec_token_ids=[], block_ids=list(range(nb)), is_new=True,
                                            needs_sample=True, params=req.sampling_params, seed=req.seed,
                                            banned_token_ids=req.min_tokens_banned))
    x, pos, md, _ = runner.prepare_inputs(sched)
    logits = target.model.compute_logits(target.model(x, pos, md, runner.kv_caches))
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(nll.item())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=400)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tokenbudget import LLM

    targets = {m: load(m) for m in MODES}
    tok = targets["none"].tokenizer
    cats = ("writing", "roleplay", "reasoning", "math", "coding", "stem", "humanities", "qa")
    chosen = spec_bench(2, cats)[:args.prompts]
    prompts = [chat_token_ids(tok, p.text) for p in chosen]
    held = " ".join(p.text for p in spec_bench(10, ("writing", "humanities", "stem")) if p not in chosen)
    ppl_ids = tok.encode(held)[:args.ppl_tokens]
    torch.set_num_threads(1)
    ppl = {m: perplexity(t, ppl_ids) for m, t in targets.items()}
    toks: dict[str, list[list[int]]] = {m: [] for m in MODES}
    tps: dict[tuple[str, int], list[float]] = {}
    for threads in args.threads:
        llms = {m: LLM(targets[m], num_threads=threads, enable_prefix_caching=False,
                       kv_cache_memory_bytes=128 << 20) for m in MODES}
        engine_generate(llms["none"], prompts[:1], 4)  # warm-up
        for p in prompts:
            for m in MODES:
                r = engine_generate(llms[m], [p], args.max_new_tokens, ignore_eos=True)
                tps.setdefault((m, threads), []).append(r.decode_tok_s)
                if threads == args.threads[0]:
                    toks[m].append(r.token_ids[0])
    rows, result = [], {"machine": machine_info(args.threads[-1]), "ppl_tokens": len(ppl_ids),
                        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "modes": {}}
    for m in MODES:
        same = sum(a == b for a, b in zip(toks[m], toks["none"]))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(toks[m], toks["none"])]
        entry = {"perplexity": round(ppl[m], 3), "greedy_identical": f"{same}/{len(prompts)}",
                 "mean_common_prefix": round(sum(prefix) / len(prefix), 1)}
        entry |= {f"decode_tok_s_{t}t": round(median(tps[(m, t)]), 1) for t in args.threads}
        result["modes"][m] = entry
        rows.append([m, *entry.values()])
    print_table(["mode", "perplexity", "greedy = fp32", "common prefix", *(f"tok/s {t}T" for t in args.threads)], rows)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
