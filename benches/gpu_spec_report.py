"""Tables and the RESULTS.md section for benches/gpu_spec.py."""

from __future__ import annotations

from benches.common import markdown_table, print_table

SPLIT_KEYS = ("schedule", "prepare", "forward", "logits", "sampler", "update", "spec", "other")


def verify_table(rows):
    heads = ["B", "k", "tokens", "ms", "x k=0"]
    return heads, [[r["batch"], r["k"], r["tokens"], round(r["ms"], 3), round(r["ratio_to_k0"], 3)] for r in rows]


def decode_table(rows):
    heads = ["B", "k", "α", "decode tok/s", "speedup", "τ", "acc", "ms/step", "lossless", "match"]
    out = []
    for r in rows:
        out.append([r["batch"], r["k"], r["alpha"] if r["k"] else "-", round(r["decode_tok_s"], 1),
                    round(r["speedup"], 2), round(r.get("tau", 1.0), 2),
                    round(r["acceptance"], 2) if "acceptance" in r else "-", round(r["ms_per_step"], 3),
                    "yes" if r["lossless"] else "NO", round(r["match"], 3)])
    return heads, out


def split_table(rows):
    heads = ["B", "k", "α", "steps"] + [f"{k} ms" for k in SPLIT_KEYS] + ["total ms"]
    out = []
    for r in rows:
        out.append([r["batch"], r["k"], r["alpha"] if r["k"] else "-", r["steps"]]
                   + [round(r["ms"][k], 3) for k in SPLIT_KEYS] + [round(r["ms"]["total"], 3)])
    return heads, out


def _sections(result: dict):
    a = result["info"]["args"]
    return [("(a) verify cost: one runner.execute, B requests × (1 + k) tokens, "
             f"context {a['context']}", verify_table(result["verify_cost"])),
            (f"(b) decode, prompt {a['prompt_len']}, {a['max_tokens']} new tokens, greedy, oracle drafter",
             decode_table(result["decode"])),
            ("(c) ms per decode step (sync-bracketed, profiled runs)", split_table(result["step_split"]))]


def print_report(result: dict) -> None:
    for title, (heads, rows) in _sections(result):
        print(f"\n{title}")
        print_table(heads, rows)


def markdown_body(results: list[dict]) -> str:
    """The RESULTS.md section: one ``###`` subsection per result (shape / device)."""
    body = ["Random-weight Llama models of realistic shapes (`benches/synthetic_model.py`, std 0.02) and an "
            "oracle drafter: the no-speculation run's greedy tokens, each draft right with probability α. "
            "`lossless` compares every token with the no-speculation run; `match` = share of tokens up "
            "to the first divergence. τ = tokens per verify step (incl. the bonus token).", ""]
    for result in results:
        info = result["info"]
        body += [f"### `{info['shape']}` ({info['params_b']:.2f}B params) on {info['device']}", "",
                 f"- Date: {info['date']}. torch {info.get('torch', '?')}, {info['dtype']}, attention backend "
                 f"`{info['attention_backend']}`, {info['kv_blocks']} KV blocks of {info['block_size']}.",
                 f"- Command: `{info.get('command', '?')}`", ""]
        for title, (heads, rows) in _sections(result):
            body += [f"**{title}**", "", markdown_table(heads, rows), ""]
    return "\n".join(body)
