"""``LimitBody``: plain ASGI middleware that bounds what reading a request body may cost.

* Size: a ``Content-Length`` over ``max_request_bytes`` is a 413 before a byte of the body is
  read; a body sent in chunks is counted as it arrives and refused once past the limit (what was
  read is dropped). So no body larger than the limit is ever held in memory.
* Time: the whole body must arrive within ``timeout_body`` seconds of the headers; otherwise 408
  and the connection is closed, dropping what was read (an upload stalled one byte short held
  its 4 MB for ever before).
* A client that disconnects before its body is complete costs one log line (``tokenbudget``,
  INFO), not a traceback.
* A large body dropped unfinished gives its memory back to the OS (``release_free_memory``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from tokenbudget.engine.entrypoints.memory import TRIM_AFTER_BYTES, release_free_memory
from tokenbudget.engine.serve.limits import flag
from tokenbudget.engine.serve.responses import error_body

logger = logging.getLogger("tokenbudget")


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


class _Gone(Exception):
    pass


class LimitBody:
    def __init__(self, app, max_request_bytes: int, timeout_body: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_request_bytes, timeout_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send, 413, f"the request body is larger than {flag('max_request_bytes')}="
                                          f"{self.max_bytes} bytes")
            return
        seen, started, complete = 0, False, False
        deadline = time.monotonic() + self.timeout

        async def bounded_receive():
            nonlocal seen, complete
            if complete:  # the body is in: what is left is the disconnect, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                raise _TooSlow from None
            if message["type"] == "http.disconnect":
                raise _Gone
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
                complete = not message.get("more_body", False)
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, watched_send)
            return
        except _TooLarge:
            if not started:
                await self._refuse(send, 413, f"the request body is larger than {flag('max_request_bytes')}="
                                              f"{self.max_bytes} bytes")
        except _TooSlow:
            if not started:
                await self._refuse(send, 408, f"the request body did not arrive within {flag('timeout_body')}="
                                              f"{self.timeout:g} seconds ({seen} bytes did)")
        except _Gone:
            client = scope.get("client") or ("?", 0)
            logger.info("tokenbudget: %s:%s disconnected after %d bytes of its request body", *client[:2], seen)
        if seen >= TRIM_AFTER_BYTES:  # what was read is dropped: give its pages back
            release_free_memory()

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        body = msgspec.json.encode(error_body(message, "invalid_request_error", None, status))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
