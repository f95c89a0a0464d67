"""KV-cache events: what a router's prefix index needs to mirror the pool's hashed blocks.

``BlockStored`` (a full block of committed tokens registered under its chained hash, with its
parent's hash, its token ids and the block size), ``BlockRemoved`` (a hash evicted),
``AllBlocksCleared`` (the prefix cache reset). The pool *stages* events as its state changes;
the scheduler *publishes* them when a step commits (``Scheduler.apply_update``) or after a
rollback (``Scheduler.rollback_step``), and a rollback first drops what the rolled-back step
staged. So a subscriber never sees an eviction a rollback undid, and sees exactly the hashes a
dirty rollback could not give back (``BlockPool._undo_new``). Draft positions are never hashed
(``KVCacheManager.cache_blocks``), so no event ever names a draft block.

Invariant (tests/test_kv_events.py): replaying every published batch into an empty model gives
the pool's ``cached`` hashes after any program of steps, faults and rollbacks. ``live`` is that
model, kept here so that a late subscriber starts from a snapshot consistent with the sequence
number it is given (``subscribe``).

Listeners are called in the publishing thread (the engine's step thread) with the batch's
sequence number and events; they must be quick (hand the batch to another thread or loop).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: int
    parent_hash: int | None  # None for a prompt's first block
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
Listener = Callable[[int, list[KVEvent]], None]


def apply_events(live: dict[int, BlockStored], events: list[KVEvent]) -> None:
    """Replay events into a model of the pool's hashed blocks (hash -> its store event)."""
    for event in events:
        if isinstance(event, BlockStored):
            live[event.block_hash] = event
        elif isinstance(event, BlockRemoved):
            live.pop(event.block_hash, None)
        else:
            live.clear()


class KVEventLog:
    """Staged events of the open step, the published sequence, and the live model."""

    def __init__(self) -> None:
        self.pending: list[KVEvent] = []
        self.sequence = 0  # of the last published batch
        self.live: dict[int, BlockStored] = {}  # insertion order: parents before children
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def stage(self, event: KVEvent) -> None:
        self.pending.append(event)

    def mark(self) -> int:
        return len(self.pending)

    def discard_from(self, mark: int) -> None:
        """Drop what was staged since ``mark`` (a rolled-back step's events)."""
        del self.pending[mark:]

    def publish(self) -> None:
        """Number the staged events as one batch, fold them into ``live`` and tell the listeners."""
        if not self.pending:
            return
        events, self.pending = self.pending, []
        with self._lock:
            self.sequence += 1
            apply_events(self.live, events)
            listeners, sequence = list(self._listeners), self.sequence
        for listener in listeners:
            listener(sequence, events)

    def subscribe(self, listener: Listener) -> tuple[int, list[BlockStored]]:
        """Register ``listener``; the sequence number and live blocks it starts from (the next
        batch it receives is numbered one more)."""
        with self._lock:
            self._listeners.append(listener)
            return self.sequence, list(self.live.values())

    def unsubscribe(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)
