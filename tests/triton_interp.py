"""Run a check function of a test file under Triton's CPU interpreter, in a child process.

``TRITON_INTERPRET=1`` must be set before triton decorates a kernel and must not leak into the
rest of the suite, hence the subprocess. If the whole process is already interpreted, the check
runs in-process.

The interpreter computes ``tl.dot`` with ``np.matmul``, i.e. numpy's BLAS, whose result for a row
depends on the row's position inside the tile on some CPUs (OpenBLAS's Haswell sgemm on an AMD
EPYC: a row alone vs the same row at position 6 of a 16-row tile differ in the last bits). That
is the host BLAS, not the kernel under test, and it would make every row-invariance check fail
(or pass) by machine. ``row_exact_interpreter_dot`` replaces the interpreter's dot with
``np.einsum``, which sums each output over K in one fixed order whatever the row's position, so
the checks test the kernel's own tiling.
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


def row_exact_interpreter_dot() -> None:
    """Make the Triton interpreter's ``tl.dot`` a fixed-order sum per output (see module doc)."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "row_exact", False):
        return
    blas_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8/int8: as triton does
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        out = np.einsum("...mk,...kn->...mn", a.data.astype(acc), b.data.astype(acc))
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    create_dot.row_exact = True
    builder.create_dot = create_dot


def run_interpreted(test_file: str, namespace: dict, func_name: str, *args) -> None:
    """Call ``func_name(*args)`` from ``test_file`` (whose globals are ``namespace``) interpreted."""
    if triton_interpret_enabled():
        row_exact_interpreter_dot()
        namespace[func_name](*args)
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
    code = (f"import runpy, triton_interp; triton_interp.row_exact_interpreter_dot(); "
            f"ns = runpy.run_path({str(Path(test_file).resolve())!r}); "
            f"ns[{func_name!r}](*{args!r})")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"interpreted check failed:\n{res.stdout}\n{res.stderr}"
