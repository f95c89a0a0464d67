"""One command for the first GPU: everything the CUDA path has never been proven to do.

From a fresh working tree on the offline GPU machine (docs/cuda.md: the carried wheels):

    bash benches/gpu_check.sh --device cuda --out benches/results/gpu_check

(installs ``.whl/*.whl`` and the project itself, offline, then runs this file). Sections, each
with its own status, time box and a JSON write after it (one failing section does not stop the
others; a killed run keeps what it finished):

1. ``cuda_tests``: ``pytest -m cuda`` over the CUDA test files (FlashInfer, graphs, Triton, EAGLE-3); the
   log is teed into ``<out>/cuda_tests.log``; on ``--device cuda`` a skipped test is a failure;
2. ``backend_vs_ref``: the selected attention backend vs torch_ref on mixed/decode/verify batches;
3. ``row_invariance``: every verify row vs the decode of its position (k = 1, 3, 4, 8; contexts
   100/1000/6000; ``unequal_verify_rows`` lists the rows that differ), the verify alone
   vs in a mixed batch, bitwise, in default and deterministic modes;
4. ``graph_vs_eager``: CUDA-graph replay vs the eager forward, uniform and padded-draft steps
   reported apart, both modes (padded may differ in default mode, by design);
5. ``verify_cost``: ms of one verify step, k = 0..8 at B = 1, 8, 32 (goal: k = 4 <= 1.1x k = 0
   at B = 1);
6. ``spec_equiv``: greedy speculation (oracle drafter, k = 4) token-identical to plain decoding
   on each ``--models`` shape, default and deterministic modes.

On ``--device cuda`` (``--require-flashinfer``, the default there) the selector may not fall back
to torch_ref (``TOKENBUDGET_ATTENTION_BACKEND=flashinfer``) and a section that ran attention is
"failed" unless FlashInfer's ``attend`` ran in it. Writes ``<out>/gpu_check.json`` and
``<out>/gpu_check.md``; the exit status is 0 only when every section is ok or skipped.

``--device cpu`` runs the same report on torch_ref with defaults sized for a CPU (the ``tiny`` and
``smollm2`` shapes, a 256 MiB KV pool); an 8B shape is refused with a message when it would not
fit. ``tests/test_gpu_check.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import tokenbudget  # noqa: E402,F401
except ImportError:  # PYTHONPATH=. is not enough: the folders map into tokenbudget.* on install
    sys.exit("tokenbudget is not installed: run `bash benches/gpu_check.sh ...` (installs it "
             "offline) or `pip install --no-index --no-deps --no-build-isolation -e .` first")

import torch  # noqa: E402

from tokenbudget.kernels.attention.base import AttentionSpec  # noqa: E402
from tokenbudget.kernels.attention.flashinfer_backend import FlashInferBackend  # noqa: E402

from benches.common import machine_info, markdown_table  # noqa: E402
from benches.gpu_check_attention import backend_vs_reference, batched_row_invariance, row_invariance  # noqa: E402
from benches.gpu_check_engine import (  # noqa: E402
    section_graph_vs_eager,
    section_spec_equiv,
    section_verify_cost,
)
from benches.synthetic_model import SHAPES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_TEST_FILES = ["tests/test_flashinfer_backend.py", "tests/test_cuda_graphs.py",
                   "tests/test_triton_kv_write.py", "tests/test_batch_invariant_matmul.py",
                   "tests/test_triton_rejection.py", "tests/test_eagle3_cuda.py"]

# Defaults per device: the GPU check's sizes; a CPU run that fits a 2-core, 24 GB CI machine.
DEFAULTS = {
    "cuda": {"models": "smollm2,8b", "dtype": "bfloat16", "verify_batches": "1,8,32", "max_k": 8,
             "context": 1000, "iters": 10, "batch": 4, "prompt_len": 32, "max_tokens": 64,
             "kv_mib": 8192, "section_timeout": 240},
    "cpu": {"models": "tiny,smollm2", "dtype": "float32", "verify_batches": "1,2", "max_k": 4,
            "context": 128, "iters": 3, "batch": 2, "prompt_len": 16, "max_tokens": 24,
            "kv_mib": 256, "section_timeout": 600},
}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def pytest_status(returncode: int, summary: str, require_flashinfer: bool) -> str:
    """ok / failed for the pytest child: with ``require_flashinfer`` (a GPU run) any skip or an
    empty selection fails, since every ``-m cuda`` test can run there."""
    if returncode not in (0, 5):
        return "failed"
    if require_flashinfer:
        skipped = re.search(r"(\d+) skipped", summary)
        if returncode == 5 or skipped:
            return f"failed ({skipped.group(0) if skipped else 'no tests ran'} on a GPU run)"
    return "ok"


def run_teed(cmd: list[str], log: str, timeout: float, env: dict) -> int | None:
    """Run ``cmd``, its output line by line into ``log`` and onto our stdout (a device call shows
    it; a killed run keeps it); None when it ran past ``timeout`` seconds (then it is killed)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, text=True)

        def pump():
            for line in proc.stdout:
                f.write(line)
                f.flush()
                sys.stdout.write(line)
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(5)
            return None
        reader.join()
    return proc.returncode


def section_cuda_tests(args) -> dict:
    if not args.pytest:
        return {"status": "skipped (--no-pytest)"}
    log = os.path.join(args.out, "cuda_tests.log")
    env = {k: v for k, v in os.environ.items() if k != "TOKENBUDGET_ATTENTION_BACKEND"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
           *args.cuda_test_files]
    rc = run_teed(cmd, log, args.pytest_timeout, env)
    if rc is None:
        return {"status": f"timeout after {args.pytest_timeout:g} s", "log": log}
    with open(log) as f:
        out = f.read()
    tail = out.strip().splitlines()[-1:] or [""]
    return {"status": pytest_status(rc, tail[0], args.require_flashinfer),
            "returncode": rc, "summary": tail[0], "log": log, "output_tail": out[-4000:]}


def _spec(args) -> AttentionSpec:
    cfg = SHAPES[args.attn_shape]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    return AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim,
                         16, dtype)


def section_backend_vs_ref(args) -> dict:
    rows = backend_vs_reference(_spec(args), torch.device(args.device))
    return {"status": "ok" if all(r["ok"] for r in rows) else "failed", "rows": rows}


def section_row_invariance(args) -> dict:
    rows = []
    for det, aligned in ((False, False), (False, True), (True, False)):
        rows += row_invariance(_spec(args), torch.device(args.device), args.ks, args.contexts, det,
                               aligned=aligned)
    # unaligned default mode may differ (that is why the wiring aligns); the rest must not
    ok = all(not r["unequal_verify_rows"] and r["verify_alone_eq_mixed"] for r in rows if r["aligned"])
    batched = []
    for det in (False, True):
        batched += batched_row_invariance(_spec(args), torch.device(args.device), args.ks, args.batch_contexts, det)
    ok = ok and not any(r["unequal"] for r in batched)
    return {"status": "ok" if ok else "failed", "rows": rows, "batched_rows": batched}


class SectionTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise SectionTimeout


def run_section(name: str, args) -> dict:
    """One section under its time box (SIGALRM: a long kernel call is interrupted when it
    returns), failed on a FlashInfer-required run unless FlashInfer's attend ran in it."""
    calls = FlashInferBackend.attend_calls
    timed = (args.section_timeout > 0 and name != "cuda_tests" and hasattr(signal, "SIGALRM")
             and threading.current_thread() is threading.main_thread())
    if timed:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(args.section_timeout)
    try:
        sec = SECTIONS[name](args)
    except SectionTimeout:
        sec = {"status": f"timeout after {args.section_timeout} s"}
    except Exception as e:  # noqa: BLE001 - record and go on to the next section
        sec = {"status": f"error: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    finally:
        if timed:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    ran = FlashInferBackend.attend_calls - calls
    if name in ATTENTION_SECTIONS:
        sec["flashinfer_attend_calls"] = ran
        if args.require_flashinfer and sec["status"].startswith("ok") and not ran:
            sec["status"] = "failed (FlashInfer did not run)"
    return sec


SECTIONS = {"cuda_tests": section_cuda_tests, "backend_vs_ref": section_backend_vs_ref,
            "row_invariance": section_row_invariance, "graph_vs_eager": section_graph_vs_eager,
            "verify_cost": section_verify_cost, "spec_equiv": section_spec_equiv}
ATTENTION_SECTIONS = ("backend_vs_ref", "row_invariance", "graph_vs_eager", "verify_cost", "spec_equiv")


def markdown(report: dict) -> str:
    lines = [f"# GPU check ({report['device']})", "", f"machine: `{json.dumps(report['machine'])}`", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']}", ""]
        extra = {k: v for k, v in sec.items() if k not in ("status", "rows", "output_tail")}
        if extra:
            lines += [f"`{json.dumps(extra, default=str)}`", ""]
        rows = sec.get("rows") or []
        if rows:
            headers = list(rows[-1])
            lines += [markdown_table(headers, [[r.get(h, "") for h in headers] for r in rows]), ""]
    return "\n".join(lines)


def section_ok(status: str) -> bool:
    return status.startswith(("ok", "skipped"))


def write_report(report: dict, out: str) -> None:
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(markdown(report))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", required=True, help="directory for gpu_check.json, gpu_check.md, cuda_tests.log")
    p.add_argument("--models", help="synthetic shapes for the engine sections (benches/synthetic_model.py; "
                   "smollm2 = the default model's shape, random weights); cuda: smollm2,8b, cpu: tiny,smollm2")
    p.add_argument("--attn-shape", default="8b", help="head layout for the attention sections")
    p.add_argument("--dtype", help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--ks", type=_ints, default=[1, 3, 4, 8])
    p.add_argument("--contexts", type=_ints, default=[100, 1000, 6000])
    p.add_argument("--batch-contexts", type=_ints, default=[99, 127, 128, 129, 200, 254, 255, 256, 257, 258],
                   help="row_invariance: one request per context, verifying / decoding together")
    p.add_argument("--verify-batches")
    p.add_argument("--max-k", type=int)
    p.add_argument("--context", type=int, help="verify_cost context")
    p.add_argument("--iters", type=int)
    p.add_argument("--batch", type=int, help="spec_equiv requests")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--kv-mib", type=int)
    p.add_argument("--no-pytest", dest="pytest", action="store_false")
    p.add_argument("--cuda-test-files", default=",".join(CUDA_TEST_FILES))
    p.add_argument("--pytest-timeout", type=float, default=300, help="seconds for the pytest child")
    p.add_argument("--section-timeout", type=int,
                   help="seconds per section but cuda_tests (0: none); cuda: 240, cpu: 600")
    p.add_argument("--require-flashinfer", action=argparse.BooleanOptionalAction, default=None,
                   help="fail sections where FlashInfer did not run (default: on for --device cuda)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.models = [m for m in args.models.split(",") if m]
    args.verify_batches = _ints(args.verify_batches)
    args.cuda_test_files = [f for f in args.cuda_test_files.split(",") if f]
    if args.require_flashinfer is None:
        args.require_flashinfer = args.device == "cuda"
    bad = [n for n in args.sections.split(",") if n not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {list(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "machine": machine_info(torch.get_num_threads()), "args": vars(args), "sections": {},
              "ok": False}
    saved = os.environ.get("TOKENBUDGET_ATTENTION_BACKEND")
    if args.require_flashinfer:
        os.environ["TOKENBUDGET_ATTENTION_BACKEND"] = "flashinfer"
    try:
        for name in args.sections.split(","):
            t = time.perf_counter()
            sec = run_section(name, args)
            sec["seconds"] = round(time.perf_counter() - t, 2)
            report["sections"][name] = sec
            report["ok"] = all(section_ok(s["status"]) for s in report["sections"].values())
            write_report(report, args.out)  # after every section: a killed run keeps what it did
            print(f"{name}: {sec['status']} ({sec['seconds']} s)", flush=True)
    finally:
        if saved is None:
            os.environ.pop("TOKENBUDGET_ATTENTION_BACKEND", None)
        else:
            os.environ["TOKENBUDGET_ATTENTION_BACKEND"] = saved
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
