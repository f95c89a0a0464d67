"""An undo log for one engine step.

While a step schedules, every component that changes state (scheduler, KV-cache manager, block
pool) records how to undo each change; if anything in the step raises, ``rollback`` undoes them
newest first, so each undo finds the state its change left. A committed step drops the log.

``rollback(dirty)``: ``dirty`` is True once a forward pass may have written KV into blocks this
step handed out. Undo functions receive it first and use it where the bits in the cache matter:
a block evicted this step does not get its prefix-cache hash back (its slots may hold the failed
step's KV), and a request preempted this step stays preempted (its freed blocks may have been
reused and overwritten). Everything else is restored exactly.
"""

from __future__ import annotations

from collections.abc import Callable


class UndoLog:
    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[tuple] = []  # (undo, *args): one object per record, GC-cheap

    def record(self, undo: Callable, *args) -> None:
        """``undo(dirty, *args)`` reverses one change."""
        self._entries.append((undo, *args))

    def rollback(self, dirty: bool) -> None:
        entries, self._entries = self._entries, []
        for entry in reversed(entries):
            entry[0](dirty, *entry[1:])

    def __len__(self) -> int:
        return len(self._entries)
