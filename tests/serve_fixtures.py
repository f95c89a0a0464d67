"""Serving test plumbing: a real uvicorn server on a free port, in a thread of the test process,
around an ``AsyncLLM`` on the shared default model (imported, not a conftest)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tokenbudget.engine.serve.server import make_server  # noqa: E402

MODEL = "smol"
KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(llm, api_key: str | None = KEY, grace_period: float = 5.0, stopper: list | None = None):
    """Serve ``llm`` at the yielded base URL (``http://127.0.0.1:PORT``) until the block ends;
    ``stopper`` receives the uvicorn server (set its ``should_exit`` to start the drain early)."""
    server = make_server(llm, MODEL, port=free_port(), api_key=api_key, grace_period=grace_period,
                         log_level="warning")
    if stopper is not None:
        stopper.append(server)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


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
