"""tests/conftest.py's CI rule, checked on synthetic test files run by a child pytest.

The child runs next to a copy of the real conftest.py. Under ``CI=true`` a missing import, a
skip naming something this machine has, and a C build that fails (a fake compiler that errors)
must fail the run; an allow-listed skip stays a skip only on a test carrying its marker (``cuda``,
``isa``) and only where the machine really lacks the thing; an xfail must be a strict marker.
Without ``CI`` the same skips stay skips (a developer's machine), but a failed C build is
a failure everywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import conftest
import pytest
import torch

COLLECT = """
import pytest
pytest.importorskip("tokenbudget_no_such_module")  # a broken install


def test_never_runs():
    pass
"""

CASES = """
import pytest


def test_skip_default_model():
    pytest.skip("default model neither cached nor downloadable: offline")


def test_skip_cuda():
    pytest.skip("needs a CUDA GPU")


@pytest.mark.cuda
def test_skip_cuda_marked():
    pytest.skip("needs a CUDA GPU")


def test_skip_cpu_flags():
    pytest.skip("CPU lacks avx2 (C kernel variant avx2)")


@pytest.mark.isa
def test_skip_cpu_flags_marked():
    pytest.skip("CPU lacks avx2 (C kernel variant avx2)")


@pytest.mark.xfail(reason="a known bug")
def test_xfail_not_strict():
    assert False


@pytest.mark.xfail(strict=True, reason="a known bug")
def test_xfail_strict():
    assert False


def test_xfail_imperative():
    pytest.xfail("a known bug")


def test_c_kernels(c_kernels):
    pass


def test_plain():
    pass
"""

BROKEN_CC = """#!/bin/sh
if [ "$1" = --version ]; then echo "brokencc 1.0"; exit 0; fi
echo "brokencc: error: deliberately broken compiler" >&2
exit 1
"""


def _outcomes(tmp_path: Path, ci: bool) -> tuple[dict[str, str], str]:
    """Run the synthetic files in a child pytest; return {test name: outcome} and its output."""
    work = tmp_path / ("ci" if ci else "dev")
    work.mkdir()
    shutil.copy(Path(conftest.__file__), work / "conftest.py")
    (work / "test_collect.py").write_text(COLLECT)
    (work / "test_cases.py").write_text(CASES)
    cc = tmp_path / "brokencc"
    if not cc.exists():
        cc.write_text(BROKEN_CC)
        cc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TOKENBUDGET_NATIVE", "PYTEST_ADDOPTS")}
    env.update(CC=str(cc), TOKENBUDGET_CACHE=str(tmp_path / "cache"))
    if ci:
        env["CI"] = "true"
    report = work / "report.xml"
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
                          "--continue-on-collection-errors", f"--junitxml={report}", str(work)],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    assert (res.returncode == 0) == all(v in ("passed", "skipped") for v in outcomes.values()), out
    return outcomes, out


def _has_simd() -> bool:
    from tokenbudget.kernels.cpu import native
    return native.selected_variant() is not None


def _expected(ci: bool) -> dict[str, str]:
    from tokenbudget.kernels.cpu import native
    has_vnni = _has_simd()
    forbidden = "error" if ci else "skipped"  # a collection-time failure is reported as an error
    return {
        "test_collect": forbidden,
        "test_skip_default_model": "failure" if ci else "skipped",
        # an allow-listed reason counts only on a test carrying its marker, and where the machine lacks it
        "test_skip_cuda": "failure" if ci else "skipped",
        "test_skip_cuda_marked": "failure" if ci and torch.cuda.is_available() else "skipped",
        "test_skip_cpu_flags": "failure" if ci else "skipped",
        "test_skip_cpu_flags_marked": "failure" if ci and not native.missing("avx2") else "skipped",
        # under CI an xfail must be a strict marker
        "test_xfail_not_strict": "failure" if ci else "skipped",
        "test_xfail_strict": "skipped",
        "test_xfail_imperative": "failure" if ci else "skipped",
        # the C build fails everywhere the kernels could run: a failure with or without CI
        "test_c_kernels": "error" if has_vnni else "skipped",
        "test_plain": "passed",
    }


@pytest.mark.parametrize("ci", [True, False], ids=["CI=true", "no CI"])
def test_ci_turns_skips_of_what_the_machine_can_run_into_failures(tmp_path, ci):
    outcomes, out = _outcomes(tmp_path, ci)
    assert outcomes == _expected(ci), out
    if ci:
        assert "CI=true: skip of something this machine can run" in out
    if _has_simd():
        assert "deliberately broken compiler" in out  # the compiler's own error, not a bare None
