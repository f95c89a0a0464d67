"""Suite-wide rules: under ``CI=true`` a skip of anything the machine can run is a failure.

A skip must name the exact thing that is missing. On a developer's machine any such skip stays a
skip; in CI (``CI=true``, set by ``.ci/run``) a skip fails the test unless its reason starts with
one of :data:`CI_ALLOWED_SKIPS` *and* that entry's check confirms the machine really lacks the
thing. So a broken install (an ``importorskip`` of a ``test``-extra package), a failed C build or
a default model that cannot be loaded turns CI red instead of quietly shrinking the suite.
``tests/test_ci_skips.py`` checks this hook on synthetic test files.

Also here: ``c_kernels`` (the C kernels of ``kernels/cpu``, or a skip naming the missing CPU
flag or compiler; a failed build is a failure).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest


def _no_cuda() -> bool:
    import torch
    return not torch.cuda.is_available()


def _no_flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is None


def _missing_cpu_flags() -> list[str]:
    """The AVX-512 VNNI (and companion) flags the C kernels need that this CPU lacks."""
    from tokenbudget.kernels.cpu.native import CPU_FLAGS
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return ["/proc/cpuinfo unreadable"]
    return [flag for flag in CPU_FLAGS if flag not in flags]


# reason prefix -> (why CI may skip it, a check that this machine really lacks the thing)
CI_ALLOWED_SKIPS = {
    "needs a CUDA GPU": ("CI runs on a CPU-only machine", _no_cuda),
    "flashinfer is not installed": ("FlashInfer is the `cuda` extra (GPU only); CI installs `.[test]`",
                                    _no_flashinfer),
    "CPU lacks": ("the C kernels need AVX-512 VNNI; without it the engine runs torch's kernels, which the "
                  "rest of the suite covers", lambda: bool(_missing_cpu_flags())),
}


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _forbidden_in_ci(report) -> str | None:
    """Why this skipped report must fail under CI=true, or None when it may stay a skip."""
    if not (report.skipped and _ci()) or hasattr(report, "wasxfail"):
        return None
    reason = _skip_reason(report)
    for prefix, (_why, machine_lacks_it) in CI_ALLOWED_SKIPS.items():
        if reason.startswith(prefix) and machine_lacks_it():
            return None
    return (f"CI=true: skip of something this machine can run ({reason!r}); only these may skip in CI, "
            f"and only where the machine lacks them: {sorted(CI_ALLOWED_SKIPS)} (tests/conftest.py)")


def _fail_forbidden_skip(report) -> None:
    why = _forbidden_in_ci(report)
    if why is not None:
        report.outcome = "failed"
        report.longrepr = why


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_forbidden_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # a module-level skip (importorskip, allow_module_level) is a collection skip
    _fail_forbidden_skip(outcome.get_result())


@pytest.fixture(scope="session")
def c_kernels():
    """The loaded C kernel library of ``kernels/cpu``.

    Skips naming the missing thing (CPU flags, a C compiler, ``TOKENBUDGET_NATIVE=0``) where the
    kernels cannot run; where they can, a ``None`` from ``library()`` means the build failed, and
    that is a failure carrying the compiler's error.
    """
    from tokenbudget.kernels.cpu import native
    if os.environ.get("TOKENBUDGET_NATIVE", "1") == "0":
        pytest.skip("TOKENBUDGET_NATIVE=0 turns the C kernels off")
    missing = _missing_cpu_flags()
    if missing:
        pytest.skip(f"CPU lacks {', '.join(missing)} (the C kernels need AVX-512 VNNI)")
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler ($CC, cc or gcc) on PATH")
    lib = native.library()
    if lib is None:
        try:
            native._build(cc)
        except (OSError, subprocess.CalledProcessError) as e:
            pytest.fail(f"the C kernels failed to build with {cc}: {getattr(e, 'stderr', '') or e}")
        pytest.fail(f"the C kernels built with {cc} but native.library() returned None")
    return lib
