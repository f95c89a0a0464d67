"""``release_free_memory``: give the heap's free pages back to the operating system.

glibc's malloc keeps what is freed (in one arena per thread that allocated) for later use, so
one large transient allocation — tokenizing a 300 KB prompt of digits builds ~90 MB of token
records, a pathological grammar's lexer tens of MB — leaves the process's RSS up after it is
freed. ``malloc_trim(0)`` returns the free pages of every arena (a few milliseconds). Called
where large transient work ends: after a large request body is prepared or refused unfinished,
and when the engine's step thread goes idle. A no-op where the C library has no ``malloc_trim``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

TRIM_AFTER_BYTES = 256 << 10  # a request body this large: its transient allocations are worth giving back


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory(collect: bool = False) -> None:
    """``collect``: first free the garbage in reference cycles too (``gc.collect()``: tens of
    milliseconds holding the GIL on a large heap, so only where nothing else runs)."""
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
