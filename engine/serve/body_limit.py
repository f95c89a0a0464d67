"""``LimitBody``: plain ASGI middleware answering 413 to a request body over ``max_request_bytes``.

A ``Content-Length`` over the limit is refused before a byte of the body is read; a body sent in
chunks is counted as it arrives and refused once past the limit (what was read is dropped). So
no body larger than the limit is ever held in memory, whatever its declared length.
"""

from __future__ import annotations

import msgspec

from tokenbudget.engine.serve.limits import flag
from tokenbudget.engine.serve.responses import error_body


class _TooLarge(Exception):
    pass


class LimitBody:
    def __init__(self, app, max_request_bytes: int) -> None:
        self.app, self.max_bytes = app, max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send)
            return
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = msgspec.json.encode(error_body(
            f"the request body is larger than {flag('max_request_bytes')}={self.max_bytes} bytes",
            "invalid_request_error", None, 413))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
