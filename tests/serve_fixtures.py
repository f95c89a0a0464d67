"""Serving test plumbing: a real uvicorn server on a free port, in a thread of the test process,
around an ``AsyncLLM`` on the shared default model (imported, not a conftest)."""

from __future__ import annotations

import contextlib
import subprocess
import time

from tokenbudget.engine.serve.server import free_port, server_in_thread, server_url  # noqa: F401

MODEL = "smol"
KEY = "test-key"


@contextlib.contextmanager
def running_server(llm, api_key: str | None = KEY, grace_period: float = 5.0, stopper: list | None = None,
                   **options):
    """Serve ``llm`` at the yielded base URL (``http://127.0.0.1:PORT``) until the block ends;
    ``stopper`` receives the uvicorn server (set its ``should_exit`` to start the drain early);
    ``options`` go to ``make_server`` (``limits=ServerLimits(...)``)."""
    with contextlib.ExitStack() as stack:
        for attempt in range(3):  # free_port() is released before uvicorn binds it: under pytest-xdist
            try:                  # another worker may take it in between; a fresh port then
                server = stack.enter_context(server_in_thread(llm, MODEL, api_key=api_key, grace_period=grace_period,
                                                              log_level="warning", **options))
                break
            except RuntimeError:
                if attempt == 2:
                    raise
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



def wait_until(cond, timeout: float, what: str) -> None:
    """Poll ``cond`` every 0.2 s until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate a server process (SIGTERM: it drains), killing it after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
