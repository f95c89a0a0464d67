"""``PreparationQueue``: request preparation off the event loop, bounded and fair between clients.

Preparing a request (decoding its body, checking the limits, the chat template, tokenizing,
compiling its grammar) costs CPU in proportion to what the client sent, up to the body limit. So:

* it runs in a few threads of its own, never on the event loop (``/health`` and every stream
  keep going) and never in the engine's step thread; those threads run at a lower CPU priority
  (``nice`` + 10 on Linux), so when cores are short the step thread (the streams already
  running) goes first and a pile of preparations only delays new requests;
* the queue is bounded: past ``max_preparing_requests`` requests waiting for or in preparation
  a new one is a 429 at once (it would only wait behind the others), and past
  ``max_preparing_per_client`` from one client address too, so one client cannot fill the
  queue for everyone;
* turns go round the clients in order (one request per client with work waiting, then the next
  client), so a client with one request waits behind at most one request of each other client,
  however many a single client sent.

The CPU-heavy calls themselves release the GIL (tokenizing: ``Tokenizer.encode``; grammar
masks: llguidance; the JSON depth scan: numpy), so the threads do not stop the event loop while
they work. The queue's state is touched on the event loop only.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from tokenbudget.api.errors import EngineOverloadedError
from tokenbudget.engine.serve.limits import flag

NICENESS = 10  # added to the preparation threads' nice value (Linux; ignored elsewhere)


def _lower_priority() -> None:
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


class PreparationQueue:
    def __init__(self, workers: int, max_requests: int, max_per_client: int) -> None:
        self.workers, self.max_requests, self.max_per_client = workers, max_requests, max_per_client
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenbudget-prepare",
                                       initializer=_lower_priority)
        self.running = 0  # jobs handed to the pool and not finished
        self.queued: dict[str, deque[asyncio.Future]] = {}  # client -> turns waiting, in round-robin order
        self.per_client: dict[str, int] = {}  # client -> requests waiting or running
        self.total = 0

    async def run(self, client: str, fn, *args):
        """``fn(*args)`` in a preparation thread when ``client``'s turn comes; its result.
        ``EngineOverloadedError`` (429) at once when the queue or the client's share is full."""
        if self.total >= self.max_requests:
            raise EngineOverloadedError(f"the server is overloaded: {self.total} requests are being prepared "
                                        f"({flag('max_preparing_requests')}={self.max_requests}); retry later")
        mine = self.per_client.get(client, 0)
        if mine >= self.max_per_client:
            raise EngineOverloadedError(f"this client has {mine} requests being prepared "
                                        f"({flag('max_preparing_per_client')}={self.max_per_client}); retry later")
        self.total += 1
        self.per_client[client] = mine + 1
        try:
            await self._turn(client)
            try:
                job = self.pool.submit(fn, *args)
            except RuntimeError:  # the pool was shut down (the server is stopping)
                self._finished()
                raise
            loop = asyncio.get_running_loop()
            # The slot is free when the thread is, even if the awaiting request was cancelled.
            job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished))
            return await asyncio.wrap_future(job)
        finally:
            self.total -= 1
            left = self.per_client[client] - 1
            if left:
                self.per_client[client] = left
            else:
                del self.per_client[client]

    async def _turn(self, client: str) -> None:
        """Return once a thread is free for ``client`` (counted in ``running``)."""
        if self.running < self.workers and not self.queued:
            self.running += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self.queued.setdefault(client, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # granted, then cancelled: pass the thread on
                self._finished()
            raise

    def _finished(self) -> None:
        self.running -= 1
        self._hand_out()

    def _hand_out(self) -> None:
        """Give free threads to the waiting clients in round-robin order."""
        while self.running < self.workers and self.queued:
            client = next(iter(self.queued))
            waiting = self.queued.pop(client)
            turn = waiting.popleft()
            if waiting:
                self.queued[client] = waiting  # to the back of the round
            if turn.done():  # its request was cancelled while it waited
                continue
            self.running += 1
            turn.set_result(None)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
