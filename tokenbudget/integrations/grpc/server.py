"""``serve_grpc``: the gRPC worker process (``tokenbudget serve --grpc PORT``).

The port opens at once and the model loads in a thread meanwhile (``HealthCheck`` says
"loading the model"); SIGTERM or SIGINT starts a drain: ``HealthCheck`` turns unhealthy, new
``Generate`` calls get UNAVAILABLE, the requests in flight have ``grace_period`` seconds to
finish, then the server stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import grpc
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from tokenbudget.integrations.grpc.servicer import TokenbudgetServicer

logger = logging.getLogger("tokenbudget")


async def run_grpc(load: Callable[[], object], model_name: str, model_path: str, host: str, port: int,
                   grace_period: float = 30.0, stop: asyncio.Event | None = None,
                   on_bound: Callable[[int, TokenbudgetServicer], None] | None = None) -> int:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT in the main thread); ``port`` 0 binds a
    free port, which ``on_bound(port, servicer)`` is told (tests run the server in a thread)."""
    servicer = TokenbudgetServicer(model_name, model_path)
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20),
                                      ("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_VllmEngineServicer_to_server(servicer, server)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise ValueError(f"--grpc: cannot bind {address}")
    address = f"{host}:{bound}"
    await server.start()
    if on_bound is not None:
        on_bound(bound, servicer)
    logger.info("tokenbudget: gRPC worker (SMG VllmEngine) on %s, loading %s", address, model_name)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread: the caller sets ``stop``
            pass
    loading = asyncio.ensure_future(asyncio.to_thread(load))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        try:
            servicer.ready(loading.result())
            logger.info("tokenbudget: gRPC worker ready on %s", address)
        except Exception as exc:  # the port stays open and HealthCheck says why, until stopped
            servicer.load_error = f"{type(exc).__name__}: {exc}"
            logger.error("tokenbudget: the model failed to load: %s", servicer.load_error)
        await stopping
    servicer.draining = True
    llm, deadline = servicer.llm, time.monotonic() + grace_period
    while llm is not None and not llm.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if llm is not None:
        await llm.shutdown()
    await server.stop(grace=1.0)
    return 0 if servicer.load_error is None else 1


def serve_grpc(load: Callable[[], object], model_name: str, model_path: str, host: str = "127.0.0.1",
               port: int = 50051, grace_period: float = 30.0) -> int:
    return asyncio.run(run_grpc(load, model_name, model_path, host, port, grace_period))
