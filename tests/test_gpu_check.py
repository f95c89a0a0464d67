"""benches/gpu_check.py end to end on CPU (torch_ref backend, tiny shapes): same report as on a
GPU, one JSON and one markdown file under the given directory."""

from __future__ import annotations

import json
import os
import time

import torch

from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend

import flashinfer_standin as fis
from benches import gpu_check
from benches.gpu_check_engine import graph_vs_eager_status, memory_refusal


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
    assert len(secs["row_invariance"]["rows"]) == 3 * 2 * 2          # modes x ks x contexts
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


# ---- issue 26: sized for the device, JSON per section, time boxes, FlashInfer must run --------

def test_cpu_defaults_fit_a_ci_machine(tmp_path):
    """N6: `--device cpu` with default sizes built the 8B shape in fp32 (OOM-killed at 21 GB)."""
    args = gpu_check.parse_args(["--device", "cpu", "--out", str(tmp_path)])
    assert args.models == ["tiny", "smollm2"] and args.dtype == "float32" and args.kv_mib == 256
    assert all(not memory_refusal(args, m) for m in args.models)
    cuda = gpu_check.parse_args(["--device", "cuda", "--out", str(tmp_path)])
    assert cuda.models == ["smollm2", "8b"] and cuda.kv_mib == 8192 and cuda.require_flashinfer


def test_a_shape_that_does_not_fit_is_refused_before_it_is_built(tmp_path):
    report = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--models", "8b",
                             "--sections", "spec_equiv", "--no-pytest"])
    status = report["sections"]["spec_equiv"]["status"]
    assert status.startswith("error: ValueError: --models 8b needs ~") and "GiB free on cpu" in status
    assert report["ok"] is False


def test_report_is_written_after_every_section_and_sections_are_time_boxed(tmp_path, monkeypatch):
    def reads_the_report(args):  # a run killed here keeps the first section's result
        saved = json.loads((tmp_path / "gpu_check.json").read_text())
        return {"status": "ok" if saved["sections"]["backend_vs_ref"]["status"] == "ok" else "failed"}

    def hangs(args):
        time.sleep(30)
        return {"status": "ok"}

    monkeypatch.setitem(gpu_check.SECTIONS, "backend_vs_ref", lambda args: {"status": "ok"})
    monkeypatch.setitem(gpu_check.SECTIONS, "row_invariance", reads_the_report)
    monkeypatch.setitem(gpu_check.SECTIONS, "verify_cost", hangs)
    report = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--attn-shape", "tiny",
                             "--sections", "backend_vs_ref,row_invariance,verify_cost",
                             "--section-timeout", "1", "--no-pytest"])
    secs = report["sections"]
    assert secs["row_invariance"]["status"] == "ok"
    assert secs["verify_cost"]["status"] == "timeout after 1 s" and secs["verify_cost"]["seconds"] < 10
    assert json.loads((tmp_path / "gpu_check.json").read_text())["ok"] is False


def test_pytest_child_log_and_time_box(tmp_path):
    args = ["--device", "cpu", "--out", str(tmp_path), "--sections", "cuda_tests",
            "--cuda-test-files", "tests/test_triton_kv_write.py"]
    sec = gpu_check.main(args)["sections"]["cuda_tests"]
    assert sec["status"] == "ok" and "skipped" in sec["summary"]  # no GPU: -m cuda skips, fine here
    assert "SKIPPED" in (tmp_path / "cuda_tests.log").read_text()  # -rs: the reasons are logged
    sec = gpu_check.main(args + ["--pytest-timeout", "0.01"])["sections"]["cuda_tests"]
    assert sec["status"] == "timeout after 0.01 s"


def test_skips_fail_a_gpu_run():
    """N3: on a GPU run every -m cuda test can run; a skip (flashinfer missing) is a failure."""
    assert gpu_check.pytest_status(0, "4 passed, 3 skipped in 9.1s", True).startswith("failed (3 skipped")
    assert gpu_check.pytest_status(5, "no tests ran in 0.1s", True).startswith("failed")
    assert gpu_check.pytest_status(0, "7 passed in 9.1s", True) == "ok"
    assert gpu_check.pytest_status(0, "4 passed, 3 skipped in 9.1s", False) == "ok"


def test_no_success_unless_flashinfer_ran(tmp_path, monkeypatch):
    """N3: without FlashInfer the selector fell back to torch_ref and every section said ok."""
    report = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--attn-shape", "tiny",
                             "--require-flashinfer", "--no-pytest",
                             "--sections", "backend_vs_ref,row_invariance"])
    for sec in report["sections"].values():
        assert sec["status"].startswith("error: ValueError: TOKENBUDGET_ATTENTION_BACKEND=flashinfer but "
                                        "flashinfer refused"), sec["status"]
    assert report["ok"] is False and "TOKENBUDGET_ATTENTION_BACKEND" not in os.environ

    def standin_attention(args):  # FlashInfer's attend really runs (the CPU stand-in)
        spec = AttentionSpec(4, 2, 16, 16, torch.float32)
        rows = backend_vs_reference_on(FlashInferBackend(spec, "cpu", flashinfer=fis, num_sms=132), spec)
        return {"status": "ok", "rows": rows}

    monkeypatch.setitem(gpu_check.SECTIONS, "backend_vs_ref", standin_attention)
    monkeypatch.setitem(gpu_check.SECTIONS, "verify_cost", lambda args: {"status": "ok"})
    report = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--require-flashinfer",
                             "--no-pytest", "--sections", "backend_vs_ref,verify_cost"])
    assert report["sections"]["backend_vs_ref"]["status"] == "ok"
    assert report["sections"]["backend_vs_ref"]["flashinfer_attend_calls"] > 0
    assert report["sections"]["verify_cost"]["status"] == "failed (FlashInfer did not run)"


def backend_vs_reference_on(backend, spec):
    from tokenbudget.kernels.attention.torch_ref import TorchRefBackend

    from benches.gpu_check_attention import Pool, run_batch
    pool = Pool(spec, 16, "cpu", 0)
    reqs = [(3, 40, pool.request(40)), (1, 17, pool.request(17))]
    q, k, v = pool.rand(4, 4, 16), pool.rand(4, 2, 16), pool.rand(4, 2, 16)
    err = (run_batch(backend, pool, reqs, q, k, v) - run_batch(TorchRefBackend(spec, "cpu"), pool, reqs, q, k, v))
    return [{"max_abs_err": err.abs().max().item()}]


def test_graph_vs_eager_reports_uniform_and_padded_apart():
    """N7: a padded step runs its bucket's tile: it may differ in default mode, never in
    deterministic mode; a uniform bucket is planned like eager in both."""
    def row(det, case, eq):
        return {"deterministic": det, "case": case, "bitwise_equal": eq}
    ok = [row(False, "uniform", True), row(True, "uniform", True), row(True, "padded", True)]
    assert graph_vs_eager_status(ok + [row(False, "padded", True)]) == "ok"
    assert graph_vs_eager_status(ok + [row(False, "padded", False)]).startswith("ok (default-mode padded")
    assert graph_vs_eager_status([row(True, "padded", False)]) == "failed"
    assert graph_vs_eager_status([row(False, "uniform", False)]) == "failed"
