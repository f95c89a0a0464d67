"""Run the app under uvicorn in a thread of this process (tests, benches, ``bench serve``).

When the server stops (``should_exit``) uvicorn stops accepting connections and waits up to
``grace_period`` seconds for the requests in flight to finish; then it cancels the rest (each
cancelled response aborts its request) and the app's lifespan ends with ``AsyncLLM.shutdown()``.
The ``tokenbudget serve`` process adds a loading gate and a drain phase in front of that
(``readiness.py``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from tokenbudget.engine.serve.app import build_app
from tokenbudget.engine.serve.connections import uvicorn_config
from tokenbudget.engine.serve.limits import ServerLimits


def make_server(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                grace_period: float = 30.0, log_level: str = "info", limits: ServerLimits | None = None,
                tool_parser: str | None = None) -> uvicorn.Server:
    app = build_app(llm, model_name, api_key, limits, tool_parser)
    config = uvicorn_config(app, limits, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=grace_period)
    return uvicorn.Server(config)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just had free on ``host`` (bind to 0, read it, release it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_url(server: uvicorn.Server) -> str:
    return f"http://{server.config.host}:{server.config.port}"


@contextlib.contextmanager
def server_in_thread(llm, model_name: str, start_timeout: float = 30.0, **options) -> Iterator[uvicorn.Server]:
    """``make_server`` on a free local port (unless ``port`` is given), run in a daemon thread of
    this process; yields the started server (``server_url(server)``; set ``should_exit`` to drain
    early) and drains it when the block ends. RuntimeError if it does not start in time."""
    options.setdefault("port", free_port(options.get("host", "127.0.0.1")))
    server = make_server(llm, model_name, **options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server for {model_name!r} did not start")
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=60)
