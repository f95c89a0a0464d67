"""The C kernels of this folder, compiled at first use and loaded with ctypes.

Two roles, two files, one library: ``quant_gemm.c`` (the weight-only GEMMs) and
``decoder_forward.c`` (the whole decoder in one call, built on those GEMMs through
``quant_gemm.h``). Why not a torch C++ extension: compiling against torch's headers is slow, these
files compile with the system C compiler in seconds and need nothing from torch (benches/RESULTS.md).
The library is cached under ``$TOKENBUDGET_CACHE`` (default ``~/.cache/tokenbudget``) keyed by the
sources, the flags and the compiler, and is written atomically (concurrent first uses are safe).

``library()`` returns None — and callers keep torch's kernels — when the CPU lacks AVX-512 VNNI,
no C compiler is found, the build fails (logged once), or ``TOKENBUDGET_NATIVE=0``. The library
links OpenMP by soname (``libgomp.so.1``), so once torch is imported it shares torch's own
OpenMP runtime and thread pool instead of starting a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tokenbudget.api.paths import cache_dir

log = logging.getLogger(__name__)

# One library: the GEMMs, and the decoder forward that calls them (through quant_gemm.h).
SOURCES = tuple(Path(__file__).with_name(name) for name in ("quant_gemm.c", "decoder_forward.c"))
HEADERS = (Path(__file__).with_name("quant_gemm.h"),)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "avx2", "f16c")
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mavx2", "-mf16c",
          "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")

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
}


def cpu_supported() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return all(flag in flags for flag in CPU_FLAGS)
    except OSError:
        pass
    return False


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    return Path(cache_dir()) / "native"


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *CFLAGS, version]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"tb_cpu_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, check=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot be used (module doc)."""
    if os.environ.get("TOKENBUDGET_NATIVE", "1") == "0" or not cpu_supported():
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found: the CPU quantized GEMMs use torch's kernels")
        return None
    import torch  # noqa: F401  (loads torch's libgomp first, so the library binds to it)
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("building the C kernels failed, the CPU quantized GEMMs use torch's kernels: %s", detail)
        return None
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib
