"""Serving test plumbing: a real uvicorn server on a free port, in a thread of the test process,
around an ``AsyncLLM`` on the shared default model (imported, not a conftest)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from tokenbudget.engine.serve.server import free_port, server_in_thread, server_url  # noqa: F401

MODEL = "smol"
KEY = "test-key"


@contextlib.contextmanager
def running_server(llm, api_key: str | None = KEY, grace_period: float = 5.0, stopper: list | None = None):
    """Serve ``llm`` at the yielded base URL (``http://127.0.0.1:PORT``) until the block ends;
    ``stopper`` receives the uvicorn server (set its ``should_exit`` to start the drain early)."""
    with server_in_thread(llm, MODEL, api_key=api_key, grace_period=grace_period, log_level="warning") as server:
        if stopper is not None:
            stopper.append(server)
        yield server_url(server)


def wait_idle(llm, timeout: float = 30.0):
    """Poll ``get_stats()`` until nothing runs or waits and no KV block is held; the stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.get_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {stats}")
        time.sleep(0.02)


class StepGate:
    """Holds an ``AsyncLLM``'s engine steps so a test, not the machine's speed, decides how far a
    request gets: while held, each ``engine.step()`` waits at the gate until the test grants it.

    ``run_until(pred)`` grants one step at a time (each once the step thread is parked at the
    gate) until ``pred()`` holds; ``open()`` lets every step through. Use as a context manager:
    leaving it opens the gate and restores ``engine.step``, so a failing test never leaves the
    step thread parked. Every wait has a deadline: a test fails, it never hangs.
    """

    def __init__(self, llm, held: bool = True, timeout: float = 60.0) -> None:
        self._engine, self._timeout = llm.engine, timeout
        self._cond = threading.Condition()
        self._permits: int | None = 0 if held else None  # None: open
        self.parked = False

    def __enter__(self) -> StepGate:
        real = self._engine.step

        def gated_step():
            with self._cond:
                self.parked = True
                self._cond.notify_all()
                granted = self._cond.wait_for(lambda: self._permits != 0, timeout=self._timeout)
                self.parked = False
                if not granted:
                    raise RuntimeError(f"StepGate: the test granted no step within {self._timeout}s")
                if self._permits is not None:
                    self._permits -= 1
            return real()
        self._engine.step = gated_step
        return self

    def __exit__(self, *exc) -> None:
        self.open()
        del self._engine.step  # back to the class's method

    def hold(self) -> None:
        with self._cond:
            self._permits = 0

    def open(self) -> None:
        with self._cond:
            self._permits = None
            self._cond.notify_all()

    def run_until(self, pred, timeout: float = 60.0) -> None:
        """Grant steps one at a time (each when the step thread is parked) until ``pred()``."""
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"StepGate.run_until: condition not met within {timeout}s"
            with self._cond:
                if self.parked and self._permits == 0:
                    self._permits = 1
                    self._cond.notify_all()
                self._cond.wait(0.02)
