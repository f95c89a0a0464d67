"""Engine test plumbing shared by the end-to-end test files (imported, not a conftest).

The default GGUF is read and dequantized once per test process (``default_loaded``, its state
dict kept for comparisons with transformers) and built into one ``TargetModel``
(``default_target``) that every engine of the process shares: engines only read weights.
``StepGate`` holds an ``AsyncLLM``'s engine steps so tests decide how far a request gets.
"""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

ENGINE_OPTS = dict(num_threads=1, kv_cache_memory_bytes=64 << 20, max_model_len=512)


def default_model_path_or_skip() -> str:
    """The default GGUF's cached path, fetched if needed.

    Skips only when the file is neither cached nor downloadable (offline), and the skip says so;
    anything else (a checksum mismatch, an unreadable cache) raises: a failure, never a skip.
    Under CI=true even that skip fails the run (tests/conftest.py): CI has the network.
    """
    from tokenbudget.engine.loader.default_model import cache_dir, default_model_path
    try:
        return default_model_path()
    except RuntimeError as exc:
        if not str(exc).startswith("could not download the default model"):
            raise
        pytest.skip(f"default model neither cached in {cache_dir()} nor downloadable: {exc}")


@functools.cache
def default_loaded():
    """The default model's files, fp32. Skips only where the file cannot be had
    (``default_model_path_or_skip``); an error in parsing, dequantizing or the tokenizer fails."""
    from tokenbudget.engine.loader import load_model_files
    return load_model_files(default_model_path_or_skip())


@functools.cache
def default_target(quantization: str = "none"):
    """The default model built from the file read once (fp32, CPU; ``quantization`` as
    ``LLM``'s); pass it as ``LLM(default_target(), ...)``."""
    from tokenbudget.engine.loader import LoadedModel
    from tokenbudget.engine.loader.target import build_target
    base = default_loaded()
    copy = LoadedModel(base.config, dict(base.state_dict), base.tokenizer, base.source, base.weight_type)
    return build_target(copy, torch.float32, torch.device("cpu"), quantization)


def assert_all_blocks_free(engine) -> None:
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


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

    def grant(self, n: int = 1) -> None:
        """Let ``n`` more steps through (without waiting for them: usable from a coroutine)."""
        with self._cond:
            assert self._permits is not None, "the gate is open"
            self._permits += n
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


def bounded(cond, max_iters: int = 20_000):
    """``while cond():`` with a bound: yields iteration numbers while ``cond()`` holds and fails
    past ``max_iters``, so a scheduler that stops making progress fails its test, never hangs it."""
    for i in range(max_iters):
        if not cond():
            return
        yield i
    raise AssertionError(f"still going after {max_iters} iterations: no progress (a livelock?)")
