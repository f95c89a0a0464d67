"""Run a check function of a test file under Triton's CPU interpreter, in a child process.

``TRITON_INTERPRET=1`` must be set before triton decorates a kernel and must not leak into the
rest of the suite, hence the subprocess. If the whole process is already interpreted, the check
runs in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenbudget.kernels.triton_utils import HAS_TRITON, triton_interpret_enabled

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_interpreted(test_file: str, namespace: dict, func_name: str, *args) -> None:
    """Call ``func_name(*args)`` from ``test_file`` (whose globals are ``namespace``) interpreted."""
    if triton_interpret_enabled():
        namespace[func_name](*args)
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
    code = (f"import runpy; ns = runpy.run_path({str(Path(test_file).resolve())!r}); "
            f"ns[{func_name!r}](*{args!r})")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"interpreted check failed:\n{res.stdout}\n{res.stderr}"
