"""A tokenbudget gRPC worker (``integrations.grpc.server.run_grpc``) in a thread of the test
process, on 127.0.0.1 and a free port, and a client channel to it."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from tokenbudget.integrations.grpc.server import run_grpc


@contextlib.contextmanager
def grpc_worker(load, model_name: str = "smol", grace_period: float = 5.0):
    """Yields (stub, servicer); the server stops (draining) when the block ends."""
    bound = threading.Event()
    state: dict = {}
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def on_bound(port, servicer):
        state.update(port=port, servicer=servicer)
        bound.set()

    def main():
        try:
            state["rc"] = loop.run_until_complete(run_grpc(load, model_name, model_name, "127.0.0.1", 0,
                                                           grace_period, stop=stop, on_bound=on_bound))
        except BaseException as exc:  # surfaced by the waiting test
            state["error"] = exc
            bound.set()

    thread = threading.Thread(target=main, name="grpc-worker", daemon=True)
    thread.start()
    assert bound.wait(60), "the gRPC worker did not bind"
    if "error" in state:
        raise state["error"]
    channel = grpc.insecure_channel(f"127.0.0.1:{state['port']}")
    try:
        yield pb_grpc.VllmEngineStub(channel), state["servicer"]
    finally:
        channel.close()
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()
