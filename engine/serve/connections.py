"""The HTTP layer in front of the app: what a connection may cost before it has sent a request.

uvicorn with httptools buffers an unfinished header line whole (8 connections x 64 MB of one
header line held 512 MB) and has no deadline for headers, so idle and slow connections stayed
open for ever (slow-loris) until the process ran out of descriptors and ``/health`` failed. The
server runs uvicorn's h11 protocol (pure Python, bounded buffers) with:

* ``h11_max_incomplete_event_size`` (uvicorn's setting): a header block larger than this while
  unfinished is answered 400 and the connection closed; nothing larger is ever buffered;
* ``timeout_headers``: a connection must complete a request's headers within this many seconds
  of connecting (or of its previous response); otherwise 408 and close (an idle new connection
  too: RFC 9110 allows a 408 there). ``timeout_keep_alive`` (uvicorn's) closes a kept-alive
  connection that sends nothing at all sooner;
* ``max_connections``: at most this many open connections (and never more than the process's
  descriptor limit less 64). Past it the connection that has been sending its request longest
  (headers or body not complete) is closed with a 408, so a new client (a probe of ``/health``)
  always gets in while the slots are held by connections that send nothing or trickle; if every
  connection has a whole request in flight, the new one is closed at once.

The body's deadline (``timeout_body``) and size are the app's (``body_limit``): they start once
the headers are in.
"""

from __future__ import annotations

import resource
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenbudget.engine.serve.limits import ServerLimits

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
DESCRIPTOR_RESERVE = 64  # descriptors left for everything else (model files, pipes, the listener)


def connection_cap(limits: ServerLimits) -> int:
    """``max_connections``, lowered to fit in the process's descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(1, min(limits.max_connections, soft - DESCRIPTOR_RESERVE))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header deadline and the connection cap; ``limits`` and
    ``cap`` are set on the subclass ``guarded_protocol`` makes for one server."""

    limits: ServerLimits = ServerLimits()
    cap: int = 1024

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sending_since: float | None = None  # monotonic: since when it sends a request not yet whole
        self._headers_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_headers()
        if len(self.connections) > self.cap:
            slowest = min((c for c in self.connections if getattr(c, "sending_since", None) is not None),
                          key=lambda c: c.sending_since, default=None)
            if slowest is None or slowest is self:  # every other one has a whole request in flight
                self._close()
            else:
                slowest.too_slow()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self._headers_timer is not None:  # the headers are in: the
            self._headers_timer.cancel()  # body's deadline is the app's (body_limit)
            self._headers_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:  # the whole request is in
            self.sending_since = None

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already received
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._await_headers()  # the next request on this connection

    def connection_lost(self, exc) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_waiting()
        self.sending_since = time.monotonic()
        self._headers_timer = self.loop.call_later(self.limits.timeout_headers, self.too_slow)

    def _stop_waiting(self) -> None:
        self.sending_since = None
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def too_slow(self) -> None:
        """408 and close: the request did not come in time (or the slot is needed). No response
        has started on the connection, so nothing else is being written to it."""
        self._stop_waiting()
        if not self.transport.is_closing() and (self.cycle is None or not self.cycle.response_started):
            self.transport.write(_TIMEOUT_RESPONSE)
        self._close()

    def _close(self) -> None:
        self._stop_waiting()
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(limits: ServerLimits) -> type[GuardedH11Protocol]:
    """The protocol class for one server under ``limits``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "cap": connection_cap(limits)})


def uvicorn_config(app, limits: ServerLimits | None, **options) -> uvicorn.Config:
    """uvicorn's config for ``app`` with the HTTP layer's limits (``options``: host, port,
    log_level, timeout_graceful_shutdown, ...)."""
    limits = limits if limits is not None else ServerLimits()
    return uvicorn.Config(app, http=guarded_protocol(limits), lifespan="on", access_log=False,
                          h11_max_incomplete_event_size=limits.h11_max_incomplete_event_size,
                          timeout_keep_alive=limits.timeout_keep_alive, **options)
