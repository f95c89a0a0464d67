"""CPU smoke test of benches/gpu_spec.py (the GPU speculation benchmark on synthetic models).

Runs the whole script with the tiny random-weight model and tiny sizes, and checks that it writes
the three sections, that the oracle drafter's runs are lossless, and the markdown section.
"""

from __future__ import annotations

import json
import random

import torch

from tokenbudget.api.sampling_params import SamplingParams

from benches import gpu_spec
from benches.synthetic_model import (
    SHAPES,
    OracleProposer,
    build_synthetic_engine,
    param_count,
)
from engine_fixtures import bounded


def test_shapes_are_realistic():
    assert abs(param_count(SHAPES["1b"]) / 1e9 - 1.24) < 0.05   # Llama-3.2-1B: 1.24B
    assert abs(param_count(SHAPES["8b"]) / 1e9 - 8.03) < 0.05   # Llama-3-8B: 8.03B


def test_oracle_drafter_acceptance_and_lossless():
    eng = build_synthetic_engine("tiny", "cpu", "float32", kv_bytes=1 << 22, max_num_seqs=4)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(12)] for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run():
        toks = {}
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        for _ in bounded(eng.has_unfinished_requests):
            for o in eng.step():
                toks.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        return toks

    ref = run()
    eng.set_speculator(OracleProposer(1.0, 512, ref), 3)
    assert run() == ref
    st = eng.speculator.stats
    assert st.num_draft_tokens and st.num_accepted_tokens == st.num_draft_tokens  # α = 1: all accepted
    eng.set_speculator(OracleProposer(0.0, 512, ref), 3)
    assert run() == ref
    assert eng.speculator.stats.num_accepted_tokens == 0  # α = 0: none accepted


def test_gpu_spec_script_cpu_smoke(tmp_path):
    out, md = tmp_path / "gs.json", tmp_path / "RESULTS.md"
    md.write_text("# Benchmark results\n\n## Other\n\nkeep me\n")
    threads = torch.get_num_threads()
    try:
        gpu_spec.main(["--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--threads", "1",
                       "--kv-gb", "0.002", "--verify-batches", "1,4", "--verify-ks", "0,1,2",
                       "--context", "32", "--verify-iters", "2", "--warmup", "1",
                       "--decode-batches", "1,4", "--prompt-len", "16", "--max-tokens", "10",
                       "--spec-ks", "2", "--alphas", "0.6,0.9", "--json", str(out),
                       "--markdown", "--results-md", str(md)])
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    assert {"info", "verify_cost", "decode", "step_split"} <= data.keys()
    assert [(r["batch"], r["k"]) for r in data["verify_cost"]] == [(b, k) for b in (1, 4) for k in (0, 1, 2)]
    assert all(r["ms"] > 0 for r in data["verify_cost"])
    decode = data["decode"]
    assert {(r["batch"], r["k"], r["alpha"]) for r in decode} == {
        (b, 0, None) for b in (1, 4)} | {(b, 2, a) for b in (1, 4) for a in (0.6, 0.9)}
    assert all(r["lossless"] and r["match"] == 1.0 for r in decode)  # oracle runs are lossless on CPU
    assert all(r["decode_tok_s"] > 0 for r in decode)
    assert all(r["tau"] >= 1.0 for r in decode if r["k"])
    assert len(data["step_split"]) == 4
    for r in data["step_split"]:
        assert set(gpu_spec.SPLIT_KEYS) <= r["ms"].keys() and r["ms"]["forward"] > 0
    text = md.read_text()
    assert f"## {gpu_spec.SECTION}" in text and "keep me" in text and "(c) ms per decode step" in text
    assert "### `tiny`" in text
    # Re-render from saved JSON (how GPU results come back): two results, two subsections.
    md2 = tmp_path / "R2.md"
    gpu_spec.main(["--from-json", str(out), str(out), "--markdown", "--results-md", str(md2)])
    assert md2.read_text().count("### `tiny`") == 2
