"""Cost of the text side on ~100 KB prompts: our SentencePiece encoder (``engine/text/spm.py``,
pure Python) beside the ``sentencepiece`` library (C++) on the same model, and the bounded chat
template render beside plain jinja2 (transformers' environment) on Qwen3's template.

A 600-piece SentencePiece BPE (byte fallback, the test's model from ``tests/spm_fixtures.py``) is
trained on the spot and read through the GGUF path. Prompt shapes: ordinary words, one repeated
character, runs of spaces (one long part: the worst case of the heap algorithm), digits, emoji
(byte fallback), CJK; each ~100 KB. Times are medians of ``--repeats`` runs with the memo cleared
first (a cold prompt). Ratios only mean something within one run.

    OMP_NUM_THREADS=1 python benches/spm_tokenizer.py --json benches/results/spm_tokenizer.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from benches.common import machine_info, median, print_table, write_json


def _prompts(size: int) -> dict[str, str]:
    from spm_fixtures import WORDS
    rng = random.Random(0)
    words = " ".join(rng.choice(WORDS) for _ in range(size // 4))[:size]
    return {"words": words, "one character": "a" * size, "spaces": " " * size,
            "digits": "".join(str(rng.randint(0, 9)) for _ in range(size)), "emoji": "🦙🎉" * (size // 8),
            "CJK": "日本語のテキスト世界你好" * (size // 36)}


def _time(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=100_000, help="characters per prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import sentencepiece as spm
    from chat_templates import QWEN3
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from spm_fixtures import gguf_metadata_for, train_sentencepiece

    from tokenbudget.engine.text.chat_template import render_chat_template
    from tokenbudget.engine.text.gguf_tokenizer import build_gguf_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = train_sentencepiece(os.path.join(tmp, "bench"), add_dummy_prefix=True)
        sp = spm.SentencePieceProcessor(model_file=model)
        ours = build_gguf_tokenizer(gguf_metadata_for(model, {}, arch="llama"))
    clear = ours._encoder._bpe._cache.clear  # a cold prompt: nothing memoised
    rows, out = [], []
    for shape, text in _prompts(args.size).items():
        assert ours.encode(text) == sp.encode(text), shape
        t_ours = _time(lambda: ours.encode(text), args.repeats, clear)
        t_sp = _time(lambda: sp.encode(text), args.repeats)
        rows.append([shape, len(text), len(sp.encode(text)), t_ours * 1e3, t_sp * 1e3, t_ours / t_sp])
        out.append(dict(zip(["shape", "chars", "tokens", "ours_ms", "sentencepiece_ms", "ratio"], rows[-1])))
    print(f"SentencePiece encode, ~{args.size // 1000} KB prompts (median of {args.repeats}, cold memo)")
    print_table(["prompt", "chars", "tokens", "ours ms", "sentencepiece ms", "ours/sp"], rows)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    plain = env.from_string(QWEN3)
    renders = []
    for n in (10, 1000):
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 20}
                    for i in range(n)]
        t_ours = _time(lambda: render_chat_template(QWEN3, messages, enable_thinking=False), args.repeats)
        t_plain = _time(lambda: plain.render(messages=messages, add_generation_prompt=True, enable_thinking=False),
                        args.repeats)
        renders.append([n, t_ours * 1e3, t_plain * 1e3, t_ours / t_plain])
    print("\nQwen3 chat template render (bounded sandbox vs plain jinja2 sandbox)")
    print_table(["messages", "ours ms", "plain ms", "ours/plain"], renders)
    write_json(args.json, {"machine": machine_info(int(os.environ.get("OMP_NUM_THREADS", "0") or 0)),
                           "encode": out, "render": [dict(zip(["messages", "ours_ms", "plain_ms", "ratio"], r))
                                                     for r in renders]})


if __name__ == "__main__":
    main()
