"""Ctrl-C that waits for a critical section to end.

A KeyboardInterrupt is raised wherever the main thread happens to be when SIGINT arrives. Inside
the parts of a step that change engine state (scheduling, committing, rolling back) it would
leave that state half changed, so those parts run under ``deferred_sigint``: a SIGINT arriving
there is held and delivered (to the handler that was installed before) as soon as the section
ends. Everything else, the forward pass included, stays interruptible; the step's rollback takes
care of it. Outside the main thread (no signals are delivered there) this does nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(*held[0])
