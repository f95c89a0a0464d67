"""The C kernels of this folder, compiled at first use and loaded with ctypes.

Why not a torch C++ extension: compiling against torch's headers takes about a minute, this file
compiles in under two seconds with the system C compiler and needs nothing from torch. The
library is cached under ``$TOKENBUDGET_CACHE`` (default ``~/.cache/tokenbudget``) keyed by the
source, the flags and the compiler, and is written atomically (concurrent first uses are safe).

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

SOURCE = Path(__file__).with_name("quant_gemm.c")
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
    # dims, fparams, layers, x, positions, cos, sin, slots, row_ctx, row_req, block_tables
    "tb_forward": ([_P] * 11, _INT),
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
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *CFLAGS, version]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"tb_cpu_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, check=True)
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
        log.warning("building %s failed, the CPU quantized GEMMs use torch's kernels: %s", SOURCE.name, detail)
        return None
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib
