"""``RequestStream``: the consumer's end of one ``AsyncLLM`` request.

The engine hands every stream DELTA outputs (only what is new each step). The stream appends
them to its buffers, so a consumer that stops reading costs memory bounded by the request's own
length (not one object per step) and O(new tokens) per step; it builds what the consumer asked
for (``SamplingParams.output_kind``) when it reads:

* DELTA: everything new since the previous read, merged into one output;
* CUMULATIVE: everything so far;
* FINAL_ONLY: one output, at the end.

A stream always ends: with the final output (``finished``), with ``RequestError`` from the
iterator when the engine ended the request with an error, with ``EngineDeadError`` when the
engine died, or, after ``AsyncLLM.abort``, with a final output whose ``finish_reason`` is
"abort". Cancelling a consumer blocked in ``__anext__`` aborts the request.

With ``n > 1`` every completion index has its own buffers; a read returns the indices with
something unread (DELTA) or every index seen so far (CUMULATIVE), in index order. Prompt logprobs
come with the first read (every read for CUMULATIVE).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, NamedTuple

from tokenbudget.api.errors import RequestError
from tokenbudget.api.outputs import CompletionOutput, RequestOutput
from tokenbudget.api.sampling_params import RequestOutputKind


class PreparedRequest(NamedTuple):
    """A request validated and tokenized by ``AsyncLLM.make_request``, not yet queued: what its
    stream will be made of."""

    request_id: str
    kind: RequestOutputKind
    text: str | None
    request: Any  # scheduler.request.Request
    arrival: float


_CUMULATIVE, _FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


class _Completion:
    """One completion index's unread pieces (all of it, for CUMULATIVE) and latest status."""

    __slots__ = ("last", "logprobs", "text", "token_ids", "unread")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list | None = None
        self.last: CompletionOutput | None = None
        self.unread = False

    def put(self, c: CompletionOutput) -> None:
        if c.text:
            self.text.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(c.logprobs)
        self.last, self.unread = c, True

    def read(self, cumulative: bool) -> CompletionOutput:
        c = self.last
        text, token_ids, logprobs = "".join(self.text), self.token_ids, self.logprobs
        if cumulative:
            self.text = [text] if text else []
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        else:
            self.text, self.token_ids = [], []
            self.logprobs = [] if logprobs is not None else None
        self.unread = False
        return CompletionOutput(index=c.index, text=text, token_ids=token_ids, cumulative_logprob=c.cumulative_logprob,
                                logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)


class RequestStream:
    def __init__(self, request_id: str, kind: RequestOutputKind, on_cancel: Callable[[str], None],
                 n: int = 1, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request_id = request_id
        self.loop = loop  # the event loop that reads it (AsyncLLM delivers there)
        self.kind = kind
        self.n = n
        self._on_cancel = on_cancel
        self._completions: dict[int, _Completion] = {}
        self._prompt_logprobs = None
        self._prompt_logprobs_read = False
        self._last: RequestOutput | None = None  # the latest delta: status, metrics, ...
        self._unread = False
        self._error: BaseException | None = None
        self._done = False  # the final output (or an error) arrived
        self._closed = False  # the consumer saw the end
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self._done

    # ---- engine side (event-loop thread)
    def put(self, out: RequestOutput) -> None:
        """Add one step's DELTA output."""
        if self._done:
            return
        for c in out.outputs:
            self._completions.setdefault(c.index, _Completion()).put(c)
        if out.prompt_logprobs is not None and self._prompt_logprobs is None:
            self._prompt_logprobs = out.prompt_logprobs
        self._last, self._unread = out, True
        if out.finished:
            self._done = True
        self._ready.set()

    def fail(self, exc: BaseException) -> None:
        if self._done:
            return
        self._error, self._done = exc, True
        self._ready.set()

    def abort(self) -> None:
        """End now with a final "abort" output for every unfinished completion (the engine frees
        the request on its side)."""
        if self._done:
            return
        last = self._last
        ended = {i for i, c in self._completions.items() if c.last is not None and c.last.finished}
        self.put(RequestOutput(request_id=self.request_id, prompt=last.prompt if last else None,
                               prompt_token_ids=last.prompt_token_ids if last else [],
                               outputs=[CompletionOutput(index=i, finish_reason="abort")
                                        for i in range(self.n) if i not in ended],
                               finished=True, metrics=last.metrics if last else None))

    # ---- consumer side
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._error is not None:
                self._closed = True
                raise self._error
            if self._unread and (self.kind != _FINAL_ONLY or self._done):
                out = self._read()
                if out.finished:
                    self._closed = True
                    if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
                        raise RequestError(self.request_id, out.error or "unknown error", out)
                return out
            self._ready.clear()
            try:
                await self._ready.wait()
            except asyncio.CancelledError:
                if not self._done:
                    self._on_cancel(self.request_id)
                raise

    def _read(self) -> RequestOutput:
        last = self._last
        cumulative = self.kind == _CUMULATIVE
        outputs = [c.read(cumulative) for _, c in sorted(self._completions.items())
                   if cumulative or c.unread]
        prompt_logprobs = self._prompt_logprobs
        if not cumulative:
            prompt_logprobs = None if self._prompt_logprobs_read else prompt_logprobs
            self._prompt_logprobs_read = self._prompt_logprobs_read or prompt_logprobs is not None
        self._unread = False
        return RequestOutput(request_id=last.request_id, prompt=last.prompt, prompt_token_ids=last.prompt_token_ids,
                             prompt_logprobs=prompt_logprobs, outputs=outputs, finished=last.finished,
                             metrics=last.metrics, error=last.error)
