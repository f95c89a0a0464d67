"""``AsyncLLM``: streamed generation for servers.

    llm = AsyncLLM()
    stream = llm.add_request("r1", "Hello", SamplingParams(max_tokens=64))   # ValueError here
    async for out in stream:
        print(out.outputs[0].text)

    async for out in llm.generate("Hello", SamplingParams(max_tokens=64)):  # the same, one call
        ...

``add_request`` validates and tokenizes at once, in the caller's thread, so a bad request is a
``ValueError`` before anything streams; it returns the request's ``RequestStream``, which
belongs to the event loop that called ``add_request``. One step thread, owned by the
``AsyncLLM`` (started on demand, ended once nothing is left to do), applies the inbox of new
requests and aborts and steps the engine, so the engine is only ever touched by one thread and
no event loop ever blocks on a forward pass. It hands each step's outputs to every stream's own
loop (``call_soon_threadsafe``). So an ``AsyncLLM`` is bound to no loop: it may be built in one
thread and used from a loop in another (Ray runs an actor's async methods that way), from
several loops at once, or from a new loop after the old one closed; a stream whose loop has
closed is aborted.

Ending: ``abort(id)`` ends that stream at once with a final "abort" output; closing or
cancelling a consumer aborts its request; an errored request's stream raises ``RequestError``;
once the engine is dead every stream and every later call raises ``EngineDeadError``.

Figures: after every step the worker thread takes an ``EngineStats`` snapshot; ``get_stats()``
answers from it while the loop runs (the event loop never reads the engine mid-step). Admission
control (``max_queued_requests`` / ``max_queued_tokens``) counts the waiting requests of that
snapshot plus the requests accepted since (``_transit``, cleared once a snapshot includes them;
both under ``_inbox_lock``): ``add_request`` raises ``EngineOverloadedError`` past either bound.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tokenbudget.api.errors import EngineDeadError
from tokenbudget.api.outputs import RequestOutput
from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams
from tokenbudget.engine.core.prompts import PromptInput
from tokenbudget.engine.core.stats import EngineStats, check_admission, request_grammar_ms
from tokenbudget.engine.entrypoints.llm_engine import LLMEngine
from tokenbudget.engine.entrypoints.memory import release_free_memory
from tokenbudget.engine.entrypoints.stream import PreparedRequest, RequestStream
from tokenbudget.request_table import RequestTable

logger = logging.getLogger("tokenbudget")


class AsyncLLM:
    def __init__(self, model=None, **options: Any) -> None:
        self.engine = LLMEngine(model=model, **options)
        self._streams: RequestTable[RequestStream] = RequestTable("streams")  # the front-end's, no step
        self._inbox_lock = threading.Lock()
        self._pending_adds: list[tuple[Any, str | None]] = []
        self._pending_aborts: list[str] = []
        self._stepping = False  # the step thread runs (under _inbox_lock)
        self._engine_lock = threading.Lock()  # held by whoever reads or steps the engine
        self._ids = itertools.count()
        self._stats: EngineStats = self.engine.get_stats()  # the snapshot after the latest step
        self._transit = [0, 0, 0.0]  # requests, prompt tokens, grammar ms accepted but not yet in a snapshot

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> RequestStream:
        """Validate, tokenize and queue a request; its stream. ValueError (nothing queued) for a
        bad request, ``EngineDeadError`` once the engine is dead, ``EngineOverloadedError`` past
        the admission bounds. Call from the event loop (a server calls ``make_request`` in a
        worker thread, then ``add_made_request``, so tokenizing never blocks the loop)."""
        return self.add_made_request(self.make_request(request_id, prompt, sampling_params, priority))

    def make_request(self, request_id: str | None, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                     priority: int = 0) -> PreparedRequest:
        """The costly, thread-safe half of ``add_request``: validate, tokenize, compile the
        grammar. Touches no stream or engine state; call it from any thread."""
        arrival = time.monotonic()
        self.engine.core.raise_if_dead()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"duplicate request_id {rid!r}: a request with this id is still running")
        params = sampling_params if sampling_params is not None else self.engine.get_default_sampling_params()
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.CUMULATIVE
        if isinstance(params, SamplingParams) and kind != RequestOutputKind.FINAL_ONLY:
            params = msgspec.structs.replace(params, output_kind=RequestOutputKind.DELTA)  # streams merge
        text, request = self.engine.make_request(rid, prompt, params, priority)
        return PreparedRequest(rid, kind, text, request, arrival)

    def add_made_request(self, prepared: PreparedRequest) -> RequestStream:
        """Queue a request from ``make_request``; its stream, read on the calling event loop."""
        self.engine.core.raise_if_dead()
        rid, request = prepared.request_id, prepared.request
        if rid in self._streams:
            raise ValueError(f"duplicate request_id {rid!r}: a request with this id is still running")
        loop = asyncio.get_running_loop()
        n = request.sampling_params.n  # each child waits and runs as one request
        masks_ms = request_grammar_ms(request)
        if self.engine.config.admission_control:
            stats = self.get_stats()
            with self._inbox_lock:
                n_transit, tokens_transit, masks_transit = self._transit
            check_admission(self.engine.config, stats.num_waiting + n_transit,
                            stats.num_waiting_tokens + tokens_transit, request.num_prompt_tokens, n,
                            stats.grammar_mask_ms + masks_transit, masks_ms)
        stream = RequestStream(rid, prepared.kind, self.abort, n, loop=loop)
        self._streams.set(rid, stream)
        with self._inbox_lock:
            self._transit[0] += n
            self._transit[1] += request.num_prompt_tokens * n
            self._transit[2] += masks_ms
            self._pending_adds.append((request, prepared.text, prepared.arrival))
        self._ensure_loop()
        return stream

    async def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate its stream; closing the iterator early aborts the request.
        A bad request raises ValueError at the first iteration."""
        stream = self.add_request(request_id, prompt, sampling_params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             request_id: str | None = None, add_generation_prompt: bool = True, *,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> RequestStream:
        """``add_request`` with the model's chat template applied to ``messages`` (the arguments
        as ``LLM.chat``'s; a bad template, kwargs or limit raises ValueError here)."""
        prompt = self.tokenizer.chat_prompt(messages, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                            tools=tools)
        return self.add_request(request_id, prompt, sampling_params)

    def abort(self, request_id: str) -> None:
        """End a request's stream now (final output "abort") and free it in the engine before the
        next step. Unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.abort()
        with self._inbox_lock:
            self._pending_aborts.append(request_id)
        self._ensure_loop()

    def is_healthy(self) -> bool:
        return self.engine.is_healthy()

    def kv_events(self):
        """The pool's ``KVEventLog`` (``kv_cache.events``), attached on first call, between steps.
        Attach it before the first request (the gRPC worker does): a hash cached before it was
        attached is in no event and no snapshot."""
        from tokenbudget.kv_cache.events import KVEventLog
        with self._engine_lock:
            pool = self.engine.scheduler.kv.pool
            if pool.events is None:
                pool.events = KVEventLog()
            return pool.events

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache hash (an ``AllBlocksCleared`` event); False, changing nothing,
        while any request is in flight (its blocks are in use)."""
        with self._engine_lock:
            if self._stepping or self.engine.has_unfinished_requests():
                return False
            return self.engine.scheduler.kv.pool.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        """Engine-wide figures (``EngineStats``): the snapshot after the latest step while the
        loop runs, a fresh one when it is idle."""
        stats = self._stats
        if not self._stepping and self._engine_lock.acquire(blocking=False):
            try:
                stats = self.engine.get_stats()
            finally:
                self._engine_lock.release()
        if stats.healthy and not self.engine.is_healthy():
            stats = msgspec.structs.replace(stats, healthy=False)
        return stats

    @property
    def idle(self) -> bool:
        """No step thread runs: every request has finished or been aborted in the engine."""
        return not self._stepping

    # ------------------------------------------------------------------ the step thread
    def _ensure_loop(self) -> None:
        """Start the step thread unless it runs (it ends itself once nothing is left to do)."""
        with self._inbox_lock:
            if self._stepping:
                return
            self._stepping = True
        try:
            origin = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (an abort from another thread): nothing to wait for
            origin = None
        threading.Thread(target=self._run, args=(origin,), name="tokenbudget-step", daemon=True).start()

    @staticmethod
    def _after_this_turn(loop, timeout: float = 0.5) -> None:
        """Wait (at most ``timeout``) until ``loop`` has finished the callback that started the
        step thread, so the requests a caller adds in one turn of its loop (a list comprehension
        of ``add_request``) reach the engine together, in one step, as they did when the loop
        stepped the engine itself."""
        turned = threading.Event()
        try:
            loop.call_soon_threadsafe(turned.set)
        except RuntimeError:  # the loop is closed
            return
        turned.wait(timeout)

    def _take_inbox(self) -> tuple[list, list[str]]:
        with self._inbox_lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
        return adds, aborts

    def _step(self, adds: list, aborts: list[str]) -> tuple[list[RequestOutput], list[tuple[str, Exception]]]:
        """Apply the inbox, then one engine step (the caller holds ``_engine_lock``)."""
        engine, rejected = self.engine, []
        aborted = set(aborts)
        for request, text, arrival in adds:
            if request.request_id in aborted:
                continue  # aborted before it reached the engine
            try:
                engine.add_made_request(request, text, arrival)
            except ValueError as exc:
                rejected.append((request.request_id, exc))
        for rid in aborts:
            engine.core.abort_request(rid)
        outputs = engine.step() if engine.has_unfinished_requests() else []
        self._stats = engine.get_stats()
        return outputs, rejected

    def _run(self, origin=None) -> None:
        """The step thread: step until no request is left and the inbox is empty."""
        if origin is not None:
            self._after_this_turn(origin)
        try:
            while True:
                adds, aborts = self._take_inbox()
                masks_ms = sum(request_grammar_ms(r) for r, _, _ in adds)  # before the engine takes the grammars
                try:
                    with self._engine_lock:
                        outputs, rejected = self._step(adds, aborts)
                finally:  # the snapshot counts them now (or they are gone)
                    with self._inbox_lock:
                        self._transit[0] -= sum(r.sampling_params.n for r, _, _ in adds)
                        self._transit[1] -= sum(r.num_prompt_tokens * r.sampling_params.n for r, _, _ in adds)
                        self._transit[2] = max(self._transit[2] - masks_ms, 0.0)
                self._dispatch([(rid, None, exc) for rid, exc in rejected]
                               + [(out.request_id, out, None) for out in outputs])
                with self._inbox_lock:
                    idle = (not self._pending_adds and not self._pending_aborts
                            and not self.engine.has_unfinished_requests())
                    if idle:
                        self._stepping = False
                if idle:
                    release_free_memory(collect=True)  # what finished requests and connections held
                    return
        except BaseException as exc:  # a dead engine, or a bug in the loop itself: no stream may hang on it
            if not isinstance(exc, EngineDeadError):
                logger.exception("tokenbudget: AsyncLLM step thread failed")
            self._fail_all(exc if isinstance(exc, Exception) else EngineDeadError(f"engine loop ended: {exc!r}"))
            with self._inbox_lock:
                self._stepping = False

    def _dispatch(self, items: list[tuple[str, RequestOutput | None, Exception | None]]) -> None:
        """Hand (request id, output, error) items to their streams, each on its own loop; the
        requests of a loop that has closed are aborted (nobody can read them)."""
        by_loop: dict[Any, list] = {}
        for item in items:
            stream = self._streams.get(item[0])
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append(item)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the loop is closed
                for rid, _, _ in batch:
                    if self._streams.pop(rid, None) is not None:
                        with self._inbox_lock:
                            self._pending_aborts.append(rid)

    def _deliver(self, batch: list) -> None:
        """On a stream's loop: one step's outputs and rejections."""
        for rid, out, exc in batch:
            stream = self._streams.get(rid)
            if stream is None:
                continue  # aborted meanwhile
            if exc is not None:
                self._streams.drop(rid)
                stream.fail(exc)
                continue
            stream.put(out)
            if out.finished:
                self._streams.drop(rid)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, RequestTable("streams")
        for stream in streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.fail, exc)
            except RuntimeError:  # its loop is closed: nobody reads it
                pass

    async def shutdown(self) -> None:
        """Abort every request and wait for the step thread to finish."""
        for rid in list(self._streams):
            self.abort(rid)
        while self._stepping:
            await asyncio.sleep(0.01)

    def get_spec_stats(self):
        return self.engine.get_spec_stats()
