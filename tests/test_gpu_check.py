"""benches/gpu_check.py end to end on CPU (torch_ref backend, tiny shapes): same report as on a
GPU, one JSON and one markdown file under the given directory."""

from __future__ import annotations

import json

from benches import gpu_check


def test_gpu_check_runs_on_cpu(tmp_path):
    report = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--models", "tiny",
                             "--attn-shape", "tiny", "--ks", "1,3", "--contexts", "40,100",
                             "--verify-batches", "1,2", "--max-k", "4", "--context", "64",
                             "--iters", "2", "--batch", "2", "--prompt-len", "8",
                             "--max-tokens", "10", "--kv-mib", "16", "--no-pytest"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(saved["sections"]) == list(gpu_check.SECTIONS)
    secs = report["sections"]
    for name in ("backend_vs_ref", "row_invariance", "verify_cost", "spec_equiv"):
        assert secs[name]["status"] == "ok", (name, secs[name])
    assert secs["graph_vs_eager"]["status"].startswith("skipped")
    assert len(secs["row_invariance"]["rows"]) == 2 * 2 * 2          # modes x ks x contexts
    assert {r["k"] for r in secs["verify_cost"]["rows"]} == set(range(5))
    assert all(r["identical"] for r in secs["spec_equiv"]["rows"])  # CPU is batch-invariant
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## spec_equiv: ok" in md and "| model | deterministic | identical" in md


def test_a_failing_section_is_recorded_not_fatal(tmp_path):
    report = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--models", "no-such-shape",
                             "--attn-shape", "tiny", "--sections", "spec_equiv,backend_vs_ref",
                             "--no-pytest"])
    assert report["sections"]["spec_equiv"]["status"].startswith("error: KeyError")
    assert report["sections"]["backend_vs_ref"]["status"] == "ok"
