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
"""

from __future__ import annotations

import asyncio
from typing import Callable

from tokenbudget.engine.api.errors import RequestError
from tokenbudget.engine.api.outputs import CompletionOutput, RequestOutput
from tokenbudget.engine.api.sampling_params import RequestOutputKind

_CUMULATIVE, _FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


class RequestStream:
    def __init__(self, request_id: str, kind: RequestOutputKind, on_cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.kind = kind
        self._on_cancel = on_cancel
        # Not yet read (all of it, for CUMULATIVE): text pieces, token ids, logprobs.
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list | None = None
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
        c = out.outputs[0]
        if c.text:
            self._text.append(c.text)
        self._token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(c.logprobs)
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
        """End now with a final "abort" output (the engine frees the request on its side)."""
        if self._done:
            return
        last = self._last
        self.put(RequestOutput(request_id=self.request_id, prompt=last.prompt if last else None,
                               prompt_token_ids=last.prompt_token_ids if last else [],
                               outputs=[CompletionOutput(finish_reason="abort")], finished=True,
                               metrics=last.metrics if last else None))

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
                    if out.outputs[0].finish_reason == "error":
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
        c = last.outputs[0]
        text, token_ids, logprobs = "".join(self._text), self._token_ids, self._logprobs
        if self.kind == _CUMULATIVE:
            self._text = [text] if text else []
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        else:
            self._text, self._token_ids = [], []
            self._logprobs = [] if logprobs is not None else None
        self._unread = False
        completion = CompletionOutput(text=text, token_ids=token_ids, cumulative_logprob=c.cumulative_logprob,
                                      logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        return RequestOutput(request_id=last.request_id, prompt=last.prompt, prompt_token_ids=last.prompt_token_ids,
                             outputs=[completion], finished=last.finished, metrics=last.metrics, error=last.error)
