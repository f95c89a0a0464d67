"""A least-recently-used cache bounded by the bytes it holds, not by its number of entries.

A count bound is no bound when one entry can be megabytes (a JSON schema with a long
description: twenty of them kept hundreds of megabytes alive after their requests ended;
benches/RESULTS.md, "Figures behind decisions in the source"). Each entry costs the
length of its key plus the length of its value (both strings); an entry larger than the whole
budget is not kept. Thread-safe: grammars are compiled in request threads, not only in the
engine's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable


class ByteBoundedCache:
    """``get_or_build(key, size_of_key, build)``: the cached value, or ``build()`` (kept when it
    fits); the least recently used entries go first once ``max_bytes`` is exceeded."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[Hashable, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_build(self, key: Hashable, key_bytes: int, build: Callable[[], str]) -> str:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        value = build()  # outside the lock: a slow build must not hold up other requests
        cost = key_bytes + len(value)
        if cost > self.max_bytes:
            return value
        with self._lock:
            if key not in self._entries:
                self._entries[key] = (value, cost)
                self.num_bytes += cost
            while self.num_bytes > self.max_bytes:
                _, (_, old) = self._entries.popitem(last=False)
                self.num_bytes -= old
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0
