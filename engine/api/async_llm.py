"""``AsyncLLM``: streamed generation for servers.

    async for out in llm.generate("Hello", SamplingParams(max_tokens=64)):
        print(out.outputs[0].text)          # cumulative text so far

One background task drives ``LLMEngine.step`` in a worker thread (so the event loop never blocks
on a forward pass) and routes each step's outputs to per-request queues. Engine calls are
serialised by one lock. Cancelling or closing a ``generate`` iterator aborts its request: the
abort is queued and applied before the next step, so the request's KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any, AsyncIterator

from tokenbudget.engine.api.llm_engine import LLMEngine
from tokenbudget.engine.api.outputs import RequestOutput
from tokenbudget.engine.api.sampling_params import SamplingParams
from tokenbudget.engine.core.prompts import PromptInput


class AsyncLLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = LLMEngine(model=model, **options)
        self._lock = threading.Lock()
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_aborts: list[str] = []
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()

    async def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that advanced it; the last is ``finished``.

        A bad request raises ValueError at the first iteration, before anything is queued.
        """
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._queues:
            raise ValueError(f"duplicate request_id {rid!r}: a request with this id is still running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        adding = asyncio.ensure_future(asyncio.to_thread(
            self._locked, self.engine.add_request, rid, prompt, sampling_params, priority))
        try:
            await asyncio.shield(adding)
        except asyncio.CancelledError:
            # The worker thread may still add the request: abort it once it has.
            self._queues.pop(rid, None)
            adding.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() is not None else self.abort(rid))
            raise
        except BaseException:
            self._queues.pop(rid, None)
            raise
        self._ensure_loop()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op for unknown or finished ids); applied before the next step."""
        self._queues.pop(request_id, None)
        with self._lock:
            if not self.engine.output_processor.has(request_id):
                return
            self._pending_aborts.append(request_id)
        self._ensure_loop()

    def _locked(self, fn, *args):
        with self._lock:
            return fn(*args)

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            aborts, self._pending_aborts = self._pending_aborts, []
            for rid in aborts:
                self.engine.abort_request(rid, missing_ok=True)
            if not self.engine.has_unfinished_requests():
                return []
            return self.engine.step()

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                outputs = await asyncio.to_thread(self._step)
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                        if out.finished:
                            del self._queues[out.request_id]
                if not self.engine.has_unfinished_requests() and not self._pending_aborts:
                    return
        except Exception as exc:  # a failed step fails every waiting stream, loudly
            for queue in self._queues.values():
                queue.put_nowait(exc)
            self._queues.clear()
            raise
        finally:
            self._loop_task = None

    def get_spec_stats(self):
        return self.engine.get_spec_stats()
