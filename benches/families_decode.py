"""Decode speed per model family on the CPU, and the default model against another checkout.

``families``: each family's tiny random model (tests/model_families.py's switches at hidden 256,
4 layers, 8 heads of 32, 2 KV heads, vocabulary 300; built by transformers, int4 on the C GEMMs)
decodes 64 tokens greedily at batch 1, interleaved repeat by repeat; the table gives the median
decode tokens/s, the ratio to the Llama model of the same size, and what runs the layers (the C
decoder forward, or torch's layer code over the C GEMMs where the C forward lacks a switch).

``--against DIR``: the default model (SmolLM2-135M Q4_1, int4 C kernels) decoding 128 tokens in
this checkout and in the checkout at DIR (its own ``.venv/bin/python``), alternating runs in
separate processes; the ratio says whether the shared path got slower.

    OMP_NUM_THREADS=1 python benches/families_decode.py --repeats 5 [--against /work/wt/bench-base] \
        [--json benches/results/families_decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tiny-model builders the tests use

SIZE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32)
# the families' own test overrides that do not fit SIZE (head_dim 16, MoE expert sizes) are replaced
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "smollm3",
            "mixtral", "qwen3_moe", "gpt_oss"]

_TIMER = r"""
import sys, time, torch
from tokenbudget import LLM, SamplingParams
llm = LLM({model!r}, num_threads=1, quantization={quant!r})
prompt = [[(7 * i) % 250 + 1 for i in range(32)]]
def run(n):
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t
run(8)
one, full = min(run(1) for _ in range(2)), min(run({tokens} + 1) for _ in range(2))
print({tokens} / (full - one))
"""


def decode_rate(python: str, model: str | None, quant: str, tokens: int, cwd: str) -> float:
    """Decode tokens/s of ``model`` in a fresh process of ``python`` (prefill excluded)."""
    code = _TIMER.format(model=model, quant=quant, tokens=tokens)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def family_dir(root: str, family: str) -> str:
    from model_families import FAMILIES as CASES
    from model_families import make_family_dir

    extra = dict(CASES[family][1])
    over = dict(SIZE)
    if "moe_intermediate_size" in extra:
        over["moe_intermediate_size"] = 256
    if family == "phi3":
        over["partial_rotary_factor"] = 0.5
        over["rope_parameters"] = dict(extra["rope_parameters"], partial_rotary_factor=0.5,
                                       short_factor=[1.0 + i / 8 for i in range(8)],
                                       long_factor=[1.0 + i for i in range(8)])
    if family == "gemma3_text":
        over["layer_types"] = ["sliding_attention", "full_attention"]
    return make_family_dir(os.path.join(root, family), family, **over)


def kernels_line(path: str) -> str:
    from tokenbudget import LLM
    from tokenbudget.engine.model.cpu_forward import kernels_summary
    return kernels_summary(LLM(path, num_threads=1, quantization="int4").engine.core.runner.model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--families", nargs="*", default=FAMILIES)
    ap.add_argument("--against", default=None, help="another checkout (with .venv) for the default model's A/B")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result: dict = {"families": {}, "default_model": None}
    with tempfile.TemporaryDirectory() as root:
        dirs = {f: family_dir(root, f) for f in args.families}
        rates = {f: [] for f in dirs}
        for _ in range(args.repeats):
            for f, d in dirs.items():
                rates[f].append(decode_rate(sys.executable, d, "int4", args.tokens, ROOT))
        base = statistics.median(rates["llama"]) if "llama" in rates else None
        print(f"{'family':14s} {'tok/s':>8s} {'vs llama':>9s}  layers")
        for f, r in rates.items():
            med = statistics.median(r)
            how = kernels_line(dirs[f])
            result["families"][f] = {"tok_s": med, "runs": r, "kernels": how}
            print(f"{f:14s} {med:8.1f} {med / base if base else float('nan'):9.2f}  {how}")
    if args.against:
        other = os.path.join(args.against, ".venv", "bin", "python")
        here, there = [], []
        for _ in range(args.repeats):
            here.append(decode_rate(sys.executable, None, "auto", 128, ROOT))
            there.append(decode_rate(other, None, "auto", 128, args.against))
        h, t = statistics.median(here), statistics.median(there)
        result["default_model"] = {"here": here, "against": there, "ratio": h / t, "against_dir": args.against}
        print(f"default model decode tok/s: this checkout {h:.1f}, {args.against} {t:.1f}, ratio {h / t:.3f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**result, "date": time.strftime("%Y-%m-%d")}, f, indent=1)


if __name__ == "__main__":
    main()
