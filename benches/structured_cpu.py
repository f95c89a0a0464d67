"""JSON generation on CPU: tokens/s with and without n-gram speculation, and the grammar mask cost.

The default model, greedy, the 22 schemas of ``tests/structured_schemas.py``. Two workloads:
``schema`` (each prompt carries its schema, as real requests do) and ``schema+example`` (plus
one example instance, few-shot style, sampled from the same grammar with a fixed seed: n-gram
drafting then finds the layout and the keys). Configurations, interleaved schema by schema in
one process (batch 1), then once more with all schemas in one batch:

* ``plain``: no speculation;
* ``ngram``: n-gram drafts (k = ``--k``), cut at the first token the grammar forbids;
* ``ngram-untrimmed``: the same without that cut (every illegal draft goes to the verify and is
  rejected there), to show what grammar-aware drafting saves.

Per configuration: output tokens, decode tokens/s (first generated token to the last; prefill
excluded, it is the same for all), steps, tokens per step, draft acceptance, and the mask cost:
milliseconds per step spent computing grammar masks for every verify row and applying them
(``StructuredOutputs.mask_seconds``) and its share of the decode time. ``identical`` checks
every configuration's text against ``plain`` (any "no" is a bug). Prints a table, writes JSON.

    OMP_NUM_THREADS=1 python benches/structured_cpu.py --json benches/results/structured_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from benches.common import machine_info, print_table, write_json
from structured_schemas import MAX_TOKENS, SCHEMAS


def _engines(target, k: int):
    from tokenbudget import LLM
    opts = {"num_threads": 1, "kv_cache_memory_bytes": 128 << 20, "max_model_len": 1024}
    ngram = {"method": "ngram", "num_speculative_tokens": k}
    engines = {"plain": LLM(target, **opts), "ngram": LLM(target, speculative_config=ngram, **opts),
               "ngram-untrimmed": LLM(target, speculative_config=ngram, **opts)}
    untrimmed = engines["ngram-untrimmed"].engine.core.structured
    untrimmed.trim_drafts = lambda batch: batch  # the ablation: illegal drafts reach the verify
    return engines


def _run(llm, prompts: list[list[int]], schemas: list[dict], stats: dict, seed: int | None = None) -> list[str]:
    """Generate to completion through ``LLMEngine.step`` (greedy, or sampled with ``seed``);
    accumulate timings into ``stats``."""
    from tokenbudget import SamplingParams, StructuredOutputsParams
    engine, core = llm.engine, llm.engine.core
    ids = [f"b{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, p, s in zip(ids, prompts, schemas):
        engine.add_request(rid, p, SamplingParams(temperature=0 if seed is None else 1.0, seed=seed,
                                                  max_tokens=MAX_TOKENS,
                                                  structured_outputs=StructuredOutputsParams(json=s)))
    texts: dict[str, str] = {}
    mask0, t_first, steps = core.structured.mask_seconds, None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        if t_first is None and outs:
            t_first, steps_first, mask_first = time.perf_counter(), steps, core.structured.mask_seconds
        for out in outs:
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
                stats["tokens"] += len(out.outputs[0].token_ids) - 1
                m = out.metrics
                stats["drafts"] += m.num_draft_tokens
                stats["accepted"] += m.num_accepted_tokens
    end = time.perf_counter()
    stats["decode_s"] += end - t_first
    stats["decode_steps"] += steps - steps_first
    stats["mask_s"] += core.structured.mask_seconds - mask_first
    stats["prefill_mask_s"] += mask_first - mask0
    return [texts[r] for r in ids]


def _summary(name: str, stats: dict, identical: bool) -> dict:
    steps = max(stats["decode_steps"], 1)
    return {"config": name, "tokens": stats["tokens"], "decode_tok_s": stats["tokens"] / stats["decode_s"],
            "steps": stats["decode_steps"], "tokens_per_step": stats["tokens"] / steps,
            "acceptance": stats["accepted"] / stats["drafts"] if stats["drafts"] else float("nan"),
            "mask_ms_per_step": 1e3 * stats["mask_s"] / steps,
            "mask_share_pct": 100 * stats["mask_s"] / stats["decode_s"], "identical": identical}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--schemas", type=int, default=len(SCHEMAS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from tokenbudget.engine.loader import load_model_files
    from tokenbudget.engine.loader.target import build_target
    torch.set_num_threads(1)
    target = build_target(load_model_files(None), torch.float32, torch.device("cpu"))
    engines = _engines(target, args.k)
    tok = engines["plain"].tokenizer
    chosen = SCHEMAS[:args.schemas]
    schemas = [s for _, _, s in chosen]

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))

    asks = [f"{p}\nReply with JSON matching this schema: {json.dumps(s)}" for _, p, s in chosen]
    examples = [_run(engines["plain"], [chat(a)], [s], _new(), seed=1)[0] for a, s in zip(asks, schemas)]
    workloads = {"schema": [chat(a) for a in asks],
                 "schema+example": [chat(f"{a}\nExample: {e}") for a, e in zip(asks, examples)]}
    result = {"info": machine_info(1), "k": args.k, "schemas": len(chosen), "runs": {}}
    keys = ["config", "tokens", "decode_tok_s", "steps", "tokens_per_step", "acceptance", "mask_ms_per_step",
            "mask_share_pct", "identical"]
    for workload, prompts in workloads.items():
        for batch in (1, len(chosen)):
            stats = {name: _new() for name in engines}
            texts: dict[str, list[str]] = {name: [] for name in engines}
            for lo in range(0, len(chosen), batch):
                for name, llm in engines.items():
                    texts[name] += _run(llm, prompts[lo:lo + batch], schemas[lo:lo + batch], stats[name])
            rows = [_summary(name, stats[name], texts[name] == texts["plain"]) for name in engines]
            result["runs"][f"{workload}, batch {batch}"] = rows
            print(f"\n{workload}, batch {batch}, {len(chosen)} schemas, greedy, k={args.k}, 1 thread")
            print_table(keys, [[r[key] for key in keys] for r in rows])
    write_json(args.json, result)


def _new() -> dict:
    return {"tokens": 0, "decode_s": 0.0, "decode_steps": 0, "drafts": 0, "accepted": 0, "mask_s": 0.0,
            "prefill_mask_s": 0.0}


if __name__ == "__main__":
    main()
