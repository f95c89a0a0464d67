"""The C kernels of this folder, one library per instruction set, compiled at first use and loaded
with ctypes.

One source, built once per **variant** (``VARIANTS``): the GEMM driver ``quant_gemm.c`` with the
variant's tile kernels (``gemm_<variant>.h``, picked by the ``-DTB_<VARIANT>`` in its flags) and
the decoder forward ``decoder_forward.c`` and the EAGLE-3 head's forward ``eagle3_head.c``
(portable C over the row ops of ``decoder_ops.h``; the variant's flags vectorize it). Why not a
torch C++ extension: compiling against torch's headers is slow, these files compile with the
system C compiler (gcc or clang) in seconds and need nothing from torch. Each library is cached
under ``$TOKENBUDGET_CACHE`` (default ``~/.cache/tokenbudget``)/native keyed by the sources, the
flags and the compiler, and written atomically (concurrent first uses are safe).

Which variant runs (``selected_variant``): ``TOKENBUDGET_NATIVE`` unset (or ``1``/``auto``) takes
the first SIMD variant of ``VARIANTS`` this CPU can execute. Where there is none, an x86 CPU (no
AVX2) takes the portable ``scalar`` variant: torch's quantized kernels have no vector path there
either, and at that instruction set they ran 12x slower than ``scalar`` (benches/RESULTS.md,
"Scalar fallback"); any other architecture keeps torch's kernels (their NEON code against ours
without the dot-product extension is unmeasured). A variant name forces it (``ValueError`` if the
name is unknown or the CPU lacks its instructions); ``0`` keeps torch's kernels. ``library()``
returns None - and callers keep torch's kernels - for ``0``, when no C
compiler is found or when the build fails (logged once; ``build_error`` says why).

OpenMP: ``-fopenmp`` (gcc, clang with libomp); on macOS ``-Xpreprocessor -fopenmp -lomp`` where
Homebrew's libomp is installed; otherwise the library is built without OpenMP and runs one thread.
On Linux it links OpenMP by soname (``libgomp.so.1``), so once torch is imported it shares
torch's own OpenMP runtime and thread pool instead of starting a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenbudget.api.paths import cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "quant_gemm.c", HERE / "decoder_forward.c", HERE / "eagle3_head.c")
HEADERS = tuple(sorted(HERE.glob("*.h")))
# What every variant is compiled with: no contraction into FMA and no -ffast-math, so the float
# operations are the ones written (the float rule in quant_gemm.c; variants agree bitwise).
COMMON_CFLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-Wno-unknown-pragmas")
ENV = "TOKENBUDGET_NATIVE"


@dataclass(frozen=True, slots=True)
class Variant:
    """One build of the kernels: the CPU features it needs (``/proc/cpuinfo`` names) and its flags."""

    name: str
    arch: str | None          # "x86_64", "aarch64", or None: any
    cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]


# In order of preference: the first one the CPU can execute runs by default.
VARIANTS = (
    Variant("avx512_vnni", "x86_64",
            ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "avx2", "f16c"),
            ("-DTB_AVX512_VNNI", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma",
             "-mavx2", "-mf16c", "-mprefer-vector-width=512")),
    Variant("avx_vnni", "x86_64", ("avx_vnni", "avx2", "fma", "f16c"),
            ("-DTB_AVX_VNNI", "-mavxvnni", "-mavx2", "-mfma", "-mf16c")),
    Variant("avx2", "x86_64", ("avx2", "fma", "f16c"), ("-DTB_AVX2", "-mavx2", "-mfma", "-mf16c")),
    Variant("neon", "aarch64", ("asimddp",), ("-DTB_NEON", "-march=armv8.2-a+dotprod")),
    Variant("scalar", None, (), ("-DTB_SCALAR",)),
)
BY_NAME = {v.name: v for v in VARIANTS}

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    # x, m, k, w, n, out, threads
    "tb_gemm_q4": ([_P, _I64, _I64, _P, _I64, _P, _INT], _INT),
    # x, m, k, w, scales, n, out, threads
    "tb_gemm_q8": ([_P, _I64, _I64, _P, _P, _I64, _P, _INT], _INT),
    # x, m, k, q, d
    "tb_quantize_rows": ([_P, _I64, _I64, _P, _P], None),
    # one TbForward struct (decoder_forward.py mirrors it)
    "tb_forward": ([_P], _INT),
    # one TbEagle3 struct (eagle3_head.py mirrors it)
    "tb_eagle3": ([_P], _INT),
    "tb_variant": ([], ctypes.c_char_p),
}


def machine() -> str:
    """``x86_64`` or ``aarch64`` (macOS says ``arm64``, Windows ``AMD64``)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature names as ``/proc/cpuinfo`` spells them (Linux ``flags``/``Features``;
    macOS from ``sysctl``)."""
    if sys.platform == "darwin":
        return _darwin_features()
    feats: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    feats.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset(feats)


def _darwin_features() -> frozenset[str]:
    def sysctl(name: str) -> str:
        proc = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    if machine() == "aarch64":
        return frozenset({"asimddp"} if sysctl("hw.optional.arm.FEAT_DotProd") == "1" else ())
    words = (sysctl("machdep.cpu.features") + " " + sysctl("machdep.cpu.leaf7_features")).lower().split()
    names = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx1.0": "avx", "avx512f": "avx512f",
             "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512vnni": "avx512_vnni"}
    return frozenset(names[w] for w in words if w in names)


def missing(variant: str) -> list[str]:
    """What this CPU lacks to execute ``variant``: its architecture or instruction names ([] = runs)."""
    v = BY_NAME[variant]
    if v.arch is not None and v.arch != machine():
        return [f"an {v.arch} CPU (this is {machine()})"]
    return [f for f in v.cpu_flags if f not in cpu_features()]


@functools.cache
def _runnable() -> tuple[str, ...]:
    return tuple(v.name for v in VARIANTS if not missing(v.name))


def runnable_variants() -> list[str]:
    """The variants this CPU can execute, best first (``scalar`` always)."""
    return list(_runnable())


def selected_variant() -> str | None:
    """The variant ``TOKENBUDGET_NATIVE`` asks for (module doc), or None for torch's kernels."""
    want = os.environ.get(ENV, "").strip().lower()
    if want == "0":
        return None
    if want in ("", "1", "auto"):
        best = runnable_variants()[0]
        return None if best == "scalar" and machine() != "x86_64" else best
    if want not in BY_NAME:
        raise ValueError(f"{ENV}={want!r}: expected one of 0, auto, {', '.join(BY_NAME)}")
    lacks = missing(want)
    if lacks:
        raise ValueError(f"{ENV}={want}: this CPU cannot execute it (missing {', '.join(lacks)})")
    return want


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _openmp_flags() -> list[tuple[str, ...]]:
    """OpenMP flag sets to try in order; the last, empty, builds a one-thread library."""
    if sys.platform == "darwin":
        tries = []
        for prefix in ("/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"):
            if os.path.isdir(prefix):
                tries.append(("-Xpreprocessor", "-fopenmp", f"-I{prefix}/include", f"-L{prefix}/lib", "-lomp"))
        return [*tries, ()]
    return [("-fopenmp",), ()]


def _cache_dir() -> Path:
    return Path(cache_dir()) / "native"


def _build(cc: str, variant: Variant) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    errors = []
    for omp in _openmp_flags():
        flags = (*COMMON_CFLAGS, *variant.cflags, *omp)
        key = hashlib.sha256("\0".join([*texts, *flags, version]).encode()).hexdigest()[:16]
        out = _cache_dir() / f"tb_cpu_{variant.name}_{key}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(tmp, out)
                if not omp:
                    log.info("C kernels (%s) built without OpenMP: they run one thread", variant.name)
                return out
            errors.append(f"{' '.join(omp) or 'no OpenMP'}: {proc.stderr.strip()[-2000:]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError("\n".join(errors))


_BUILD_ERRORS: dict[str, str] = {}


def build_error(variant: str) -> str | None:
    """Why ``load(variant)`` returned None (None if it did not, or was not tried)."""
    return _BUILD_ERRORS.get(variant)


@functools.cache
def load(variant: str) -> ctypes.CDLL | None:
    """The library of ``variant`` (built if needed), or None where it cannot be built (logged).
    The caller makes sure the CPU can execute it (``missing``)."""
    v = BY_NAME[variant]
    cc = _compiler()
    if cc is None:
        _BUILD_ERRORS[variant] = "no C compiler found (cc, gcc, clang or $CC)"
        log.info("no C compiler found: the CPU quantized GEMMs use torch's kernels")
        return None
    import torch  # noqa: F401  (loads torch's libgomp first, so the library binds to it)
    try:
        lib = ctypes.CDLL(str(_build(cc, v)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        _BUILD_ERRORS[variant] = detail
        log.warning("building the C kernels (%s) failed, the CPU quantized GEMMs use torch's kernels: %s", variant,
                    detail)
        return None
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    assert lib.tb_variant().decode() == variant
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library of the selected variant, or None where torch's kernels run (module doc)."""
    variant = selected_variant()
    return None if variant is None else load(variant)


def unavailable_reason() -> str:
    """Why torch's kernels run instead of the C kernels ("" where the C kernels load), for the
    start-up line."""
    try:
        variant = selected_variant()
    except ValueError as e:
        return str(e)
    if variant is None:
        if os.environ.get(ENV, "").strip() == "0":
            return f"{ENV}=0"
        return f"no SIMD kernel variant for this CPU; {ENV}=scalar runs the portable one"
    if load(variant) is None:
        return f"the C {variant} build failed: {(build_error(variant) or '').splitlines()[-1:]}"
    return ""
