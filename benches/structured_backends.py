"""Compare xgrammar and llguidance on this CPU, on the default model's vocabulary.

For each backend: tokenizer set-up time, compile time per JSON schema (the test set in
``tests/structured_schemas.py``), mask time per token (a bitmask over the whole vocabulary,
computed while walking a random legal token path through each schema with a fixed seed), and
whether rollback restores the state exactly (the mask after ``accept k tokens, rollback k``
equals the mask before). Prints a table and writes JSON.

    OMP_NUM_THREADS=1 python benches/structured_backends.py --json benches/results/structured_backends.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from structured_schemas import SCHEMAS

SEPARATORS = (", ", ": ")


def _allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


class _Xgr:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        backend_str = tokenizer.backend.to_str()
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend_str)
        encoded = [""] * vocab_size
        for tok, i in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            encoded[i] = tok
        info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=[eos],
                                 add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def new_mask(self) -> np.ndarray:
        return np.full((1, (self.vocab + 31) // 32), -1, dtype=np.int32)

    def fill(self, m, mask: np.ndarray) -> None:
        import torch
        m.fill_next_token_bitmask(torch.from_numpy(mask), 0)

    def accept(self, m, t: int) -> bool:
        return m.accept_token(t)

    def rollback(self, m, k: int) -> None:
        m.rollback(k)

    def done(self, m) -> bool:
        return m.is_terminated()


class _Llg:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        import llguidance
        import llguidance.numpy as llnp
        self.llg, self.llnp = llguidance, llnp
        self.tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.vocab = vocab_size
        self.opts = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=self.opts)
        m = self.llg.LLMatcher(self.tok, grammar)  # llguidance compiles lazily, per matcher
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def new_mask(self) -> np.ndarray:
        return self.llnp.allocate_token_bitmask(1, self.vocab)

    def fill(self, m, mask: np.ndarray) -> None:
        self.llnp.fill_next_token_bitmask(m, mask, 0)

    def accept(self, m, t: int) -> bool:
        return m.consume_token(t)

    def rollback(self, m, k: int) -> None:
        m.rollback(k)

    def done(self, m) -> bool:
        return m.is_stopped()


def measure(backend, seed: int, max_steps: int) -> dict:
    compile_s, first_s, mask_s, steps, rollback_ok, errors = [], [], [], 0, True, []
    rng = random.Random(seed)
    for name, _, schema in SCHEMAS:
        t0 = time.perf_counter()
        try:
            compiled = backend.compile(schema)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot compile a schema is a finding
            errors.append(f"{name}: {exc}")
            continue
        compile_s.append(time.perf_counter() - t0)
        m = backend.matcher(compiled)
        mask = backend.new_mask()
        backend.fill(m, mask)  # llguidance builds lazily: compile + first mask is the fair total
        first_s.append(time.perf_counter() - t0)
        history: list[np.ndarray] = []
        for _ in range(max_steps):
            t0 = time.perf_counter()
            backend.fill(m, mask)
            mask_s.append(time.perf_counter() - t0)
            history.append(mask.copy())
            allowed = _allowed(mask[0], backend.vocab)
            if not len(allowed) or not backend.accept(m, int(rng.choice(list(allowed)))):
                errors.append(f"{name}: stuck")
                break
            steps += 1
            if backend.done(m):
                break
        k = min(4, len(history) - 1)
        if k > 0:  # roll back k tokens: the mask must equal the one computed k tokens ago
            backend.rollback(m, k)
            backend.fill(m, mask)
            rollback_ok &= bool(np.array_equal(mask, history[-k]))
    return {"backend": backend.name, "schemas": len(compile_s), "errors": errors,
            "compile_ms_median": 1e3 * statistics.median(compile_s), "compile_ms_max": 1e3 * max(compile_s),
            "first_mask_ms_median": 1e3 * statistics.median(first_s), "first_mask_ms_max": 1e3 * max(first_s),
            "mask_us_median": 1e6 * statistics.median(mask_s), "mask_us_mean": 1e6 * statistics.mean(mask_s),
            "mask_us_p99": 1e6 * float(np.percentile(mask_s, 99)), "tokens": steps, "rollback_exact": rollback_ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from tokenbudget.engine.loader import load_model_files
    files = load_model_files(None)
    vocab, eos = files.config.vocab_size, files.tokenizer.eos_token_id
    rows = []
    for cls in (_Xgr, _Llg):
        t0 = time.perf_counter()
        backend = cls(files.tokenizer, vocab, eos)
        setup = time.perf_counter() - t0
        row = measure(backend, args.seed, args.max_steps)
        row["tokenizer_setup_ms"] = 1e3 * setup
        rows.append(row)
    print(f"vocabulary {vocab} tokens, {len(SCHEMAS)} schemas, 1 thread")
    print(f"{'backend':<11} {'setup ms':>9} {'compile ms med/max':>19} {'+1st mask ms med/max':>21} "
          f"{'mask us med/mean/p99':>22} "
          f"{'tokens':>7} {'rollback':>9} errors")
    for r in rows:
        print(f"{r['backend']:<11} {r['tokenizer_setup_ms']:9.1f} "
              f"{r['compile_ms_median']:9.2f}/{r['compile_ms_max']:<9.2f}"
              f" {r['first_mask_ms_median']:10.2f}/{r['first_mask_ms_max']:<10.2f}"
              f" {r['mask_us_median']:7.1f}/{r['mask_us_mean']:6.1f}/{r['mask_us_p99']:<7.1f} {r['tokens']:7d}"
              f" {r['rollback_exact']!s:>9} {len(r['errors'])}")
        for e in r["errors"]:
            print("   ", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab_size": vocab, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
