"""A replica a router can drive: ``/health`` is 503 while the model loads and while draining.

Routers (SMG, vllm-router, llm-d, Kubernetes readiness probes) send traffic to a replica whose
``GET /health`` answers 200 and stop when it answers 503. ``tokenbudget serve`` therefore binds
its port *before* the model loads (``ReplicaGate`` answers every route 503 "loading", with
``Retry-After``, until the app is ready) and drains *before* it stops listening:

1. SIGTERM (or SIGINT) flips the gate to draining: ``/health`` and every new inference request
   get 503 (a router retries them elsewhere); requests in flight go on; ``/metrics``,
   ``/v1/models`` and ``/version`` still answer.
2. Once nothing is in flight (or ``grace_period`` has passed) uvicorn's own shutdown runs: it
   stops listening, waits what is left of the grace period, aborts the rest, and the lifespan
   ends with ``AsyncLLM.shutdown()``. A second signal skips the wait.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

import msgspec
import uvicorn

from tokenbudget.engine.serve import responses as resp
from tokenbudget.engine.serve.connections import uvicorn_config

logger = logging.getLogger("tokenbudget")

_PROBES = ("/metrics", "/v1/models", "/version")  # still answered while draining


class ReplicaGate:
    """ASGI app in front of the OpenAI app: 503 until ``open``, 503 for ``/health`` and new work
    while ``draining``; counts the requests in flight (``in_flight``)."""

    def __init__(self) -> None:
        self.app = None
        self.llm = None
        self.draining = False
        self.in_flight = 0  # touched on the server's event loop only

    def open(self, app, llm) -> None:
        self.llm, self.app = llm, app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if self.app is None:
            await _unavailable(scope, send, "the model is still loading")
            return
        if self.draining and scope["type"] == "http" and scope["path"] not in _PROBES:
            await _unavailable(scope, send, "the server is draining (shutting down)")
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.llm is not None:
                    await self.llm.shutdown()  # after the drain: abort what is left
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _unavailable(scope, send, message: str) -> None:
    if scope["type"] != "http":  # a websocket: refuse it
        await send({"type": "websocket.close", "code": 1013})
        return
    body = msgspec.json.encode(resp.error_body(message, "server_error", None, 503))
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain phase before its shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, gate: ReplicaGate, grace_period: float) -> None:
        super().__init__(config)
        self.gate, self.grace_period = gate, grace_period
        self._drain_deadline = 0.0

    def drain(self) -> None:
        """Start draining (the first SIGTERM does this); idempotent."""
        if not self.gate.draining:
            self._drain_deadline = time.monotonic() + self.grace_period
            self.gate.draining = True

    def handle_exit(self, sig, frame) -> None:
        if not self.gate.draining and not self.should_exit and self.gate.app is not None:
            self._captured_signals.append(sig)
            self.drain()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if (self.gate.draining and not self.should_exit
                and (self.gate.in_flight == 0 or time.monotonic() > self._drain_deadline)):
            self.should_exit = True
        return await super().on_tick(counter)


def make_replica_server(load: Callable[[], object], model_name: str, host: str = "127.0.0.1", port: int = 8000,
                        api_key: str | None = None, grace_period: float = 30.0, log_level: str = "info",
                        app_options: dict | None = None) -> tuple[DrainingServer, threading.Thread]:
    """A server that listens at once and serves ``build_app(llm, model_name, api_key,
    **app_options)`` once ``load()`` (an ``AsyncLLM``) returns; the loader thread (not started).
    A failed load stops the server (``server.load_error``); a ``ValueError``/``OSError`` (a bad
    model path or file) is left to the caller to report, anything else is logged with its
    traceback."""
    from tokenbudget.engine.serve.app import build_app

    gate = ReplicaGate()
    config = uvicorn_config(gate, (app_options or {}).get("limits"), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=grace_period)
    server = DrainingServer(config, gate, grace_period)
    server.load_error = None

    def loader() -> None:
        try:
            llm = load()
            gate.open(build_app(llm, model_name, api_key, **(app_options or {})), llm)
            logger.info("tokenbudget: %s loaded; /health is 200", model_name)
        except BaseException as exc:  # noqa: BLE001 - reported, and the server stops
            if not isinstance(exc, (ValueError, OSError)):  # a bad model path or file: the caller's one line
                logger.exception("tokenbudget: loading %s failed", model_name)
            server.load_error = exc
            server.should_exit = True

    return server, threading.Thread(target=loader, name="tokenbudget-load", daemon=True)


def serve_replica(load: Callable[[], object], model_name: str, **options) -> int:
    """Serve until SIGTERM/SIGINT (drained); 0 after a clean drain, 1 if the model did not load.
    A model the user named wrongly (a missing path, a file that is no model: ``ValueError`` or
    ``OSError`` from the load) raises ``ValueError`` after the server stopped, so the CLI answers
    with its one-line error and exit status 2, as for any other bad flag."""
    server, loader = make_replica_server(load, model_name, **options)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # uvicorn re-raises what it handled
    loader.start()
    server.run()
    if isinstance(server.load_error, (ValueError, OSError)):
        raise ValueError(f"model: {server.load_error}") from None
    return 0 if server.started and server.load_error is None else 1
