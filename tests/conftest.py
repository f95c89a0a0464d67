"""Suite-wide rules: under ``CI=true`` a skip of anything the machine can run is a failure.

A skip must name the exact thing that is missing. On a developer's machine any such skip stays a
skip; in CI (``CI=true``, set by ``.ci/run``) a skip fails the test unless its reason starts with
one of :data:`CI_ALLOWED_SKIPS` *and* that entry's check confirms the machine really lacks the
thing. So a broken install (an ``importorskip`` of a ``test``-extra package), a failed C build or
a default model that cannot be loaded turns CI red instead of quietly shrinking the suite.
``tests/test_ci_skips.py`` checks this hook on synthetic test files.

Also here: ``c_kernels`` (the C kernels of ``kernels/cpu`` in the variant this CPU runs by
default, or a skip naming the missing instructions or compiler; a failed build is a failure).
A C kernel variant's skip says ``CPU lacks ... (C kernel variant NAME)`` (tests/native_variants.py):
allowed in CI only where ``kernels.cpu.native.missing(NAME)`` confirms it.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from tokenbudget.kernels.cpu.native import VARIANTS


def _no_cuda(reason: str) -> bool:
    import torch
    return not torch.cuda.is_available()


def _no_flashinfer(reason: str) -> bool:
    return importlib.util.find_spec("flashinfer") is None


def _variant_missing(reason: str) -> bool:
    """The skipped C kernel variant (named in the reason) really cannot run on this CPU."""
    from tokenbudget.kernels.cpu import native
    found = re.search(r"\(C kernel variant (\w+)\)", reason)
    return found is not None and found.group(1) in native.BY_NAME and bool(native.missing(found.group(1)))


# reason prefix -> (why CI may skip it, the marker a test must carry for the reason to count, a check,
# given the reason, that this machine really lacks the thing)
CI_ALLOWED_SKIPS = {
    "needs a CUDA GPU": ("CI runs on a CPU-only machine", "cuda", _no_cuda),
    "flashinfer is not installed": ("FlashInfer is the `cuda` extra (GPU only); CI installs `.[test]`", "cuda",
                                    _no_flashinfer),
    "CPU lacks": ("a C kernel variant for other instructions (NEON on x86: tests/test_neon_qemu.py runs it "
                  "under qemu); the CPU's own variants and scalar always run", "isa", _variant_missing),
}
# Fixtures that run a C kernel variant: a test using one is an ``isa`` test by what it asks for.
ISA_FIXTURES = ("variant", "c_kernels", "quant_kernel")


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _forbidden_in_ci(report, markers: frozenset[str] | None = None) -> str | None:
    """Why this skipped report must fail under CI=true, or None when it may stay a skip. ``markers``:
    the test's markers (None for a collection report: a whole module skipped with an allowed
    reason must mark itself, ``pytestmark``, which a skip at import cannot show: so it fails)."""
    if not (report.skipped and _ci()) or hasattr(report, "wasxfail"):
        return None
    reason = _skip_reason(report)
    for prefix, (_why, marker, machine_lacks_it) in CI_ALLOWED_SKIPS.items():
        if reason.startswith(prefix) and machine_lacks_it(reason):
            if markers is not None and marker in markers:
                return None
            return (f"CI=true: the skip {reason!r} counts only on a test marked @pytest.mark.{marker} "
                    f"(tests/conftest.py): mark the test, or skip for the reason that is really missing")
    return (f"CI=true: skip of something this machine can run ({reason!r}); only these may skip in CI, "
            f"and only where the machine lacks them: {sorted(CI_ALLOWED_SKIPS)} (tests/conftest.py)")


def _forbidden_xfail(item, call, report) -> str | None:
    """Under CI=true an xfail must be ``strict=True`` (an unexpected pass fails) and declared as a
    marker: a non-strict one, or a ``pytest.xfail()`` call in the test, hides a fixed or a new bug."""
    if not _ci() or call.when != "call":
        return None
    if call.excinfo is not None and call.excinfo.errisinstance(pytest.xfail.Exception):
        return "CI=true: pytest.xfail() inside a test; use @pytest.mark.xfail(strict=True, reason=...)"
    for mark in item.iter_markers("xfail"):
        if mark.kwargs.get("strict") is not True:
            return "CI=true: an xfail must be strict=True (an unexpected pass must fail the run)"
    return None


def _fail(report, why: str | None) -> None:
    if why is not None:
        report.outcome = "failed"
        report.longrepr = why
        if hasattr(report, "wasxfail"):  # no longer an expected failure (reports and junit read it first)
            del report.wasxfail


def pytest_collection_modifyitems(items):
    for item in items:
        if any(name in item.fixturenames for name in ISA_FIXTURES):
            item.add_marker(pytest.mark.isa)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    _fail(report, _forbidden_xfail(item, call, report)
          or _forbidden_in_ci(report, frozenset(m.name for m in item.iter_markers())))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # a module-level skip (importorskip, allow_module_level) is a collection skip
    report = outcome.get_result()
    _fail(report, _forbidden_in_ci(report))


@pytest.fixture(autouse=True)
def _torch_seeded_and_threads_restored(request):
    """Every test starts from torch's global RNG seeded by its own id (a test that draws without a
    generator is reproducible, the same whatever ran before it) and leaves torch's thread count as
    it found it (a fixture that sets 1 thread changed every later test's speed and schedules)."""
    import zlib

    import torch
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def c_kernels():
    """The loaded C kernel library of ``kernels/cpu``, in the variant the engine picks here.

    Skips naming the missing thing (the instructions of a SIMD variant, a C compiler,
    ``TOKENBUDGET_NATIVE=0``) where the kernels cannot run; where they can, a failed build is a
    failure carrying the compiler's error.
    """
    from tokenbudget.kernels.cpu import native
    if os.environ.get("TOKENBUDGET_NATIVE", "1") == "0":
        pytest.skip("TOKENBUDGET_NATIVE=0 turns the C kernels off")
    variant = native.selected_variant()
    if variant is None:  # only scalar runs here, and the engine keeps torch's kernels then
        pytest.skip(f"CPU lacks {', '.join(native.missing('avx2'))} (C kernel variant avx2)")
    if native._compiler() is None:
        pytest.skip("no C compiler ($CC, cc, gcc or clang) on PATH")
    lib = native.load(variant)
    if lib is None:
        pytest.fail(f"the C kernels ({variant}) failed to build: {native.build_error(variant)}")
    return lib


@pytest.fixture(params=[v.name for v in VARIANTS])
def variant(request, monkeypatch) -> str:
    """Each C kernel variant in turn, selected for the test (tests/native_variants.py): skipped
    naming the missing instructions where the CPU cannot run it, a failed build fails in CI."""
    from native_variants import use_variant
    use_variant(request.param, monkeypatch)
    return request.param
