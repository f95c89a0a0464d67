"""Errors a caller of the engine can catch by name.

* ``ValueError``: bad input (a field of ``SamplingParams``, ``EngineConfig``, a prompt, a request
  id). Raised before anything runs; nothing else is disturbed.
* ``RequestError``: one request failed inside a step (the engine isolated it; the others go on).
  ``AsyncLLM`` streams raise it from their iterator; ``LLM.generate`` returns the request's
  output with ``finish_reason="error"`` instead.
* ``EngineDeadError``: the engine stopped serving (a fault that every request hits, or too many
  failed steps in a row). Every stream and every later call raises it at once.
* ``EngineOverloadedError``: admission control refused a request (``max_queued_requests`` /
  ``max_queued_tokens``); try again later.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine is dead; ``__cause__`` is the fault that killed it. ``failed_alone``: the
    requests of the last step, each of which failed alone too (empty when the engine died of too
    many failed steps in a row)."""

    def __init__(self, message: str, failed_alone: list[str] | None = None) -> None:
        super().__init__(message)
        self.failed_alone = list(failed_alone or [])


class RequestError(RuntimeError):
    """A request finished with ``finish_reason="error"``; ``output`` is its final output."""

    def __init__(self, request_id: str, message: str, output=None) -> None:
        super().__init__(f"request {request_id!r} failed: {message}")
        self.request_id = request_id
        self.output = output


class EngineOverloadedError(RuntimeError):
    """Admission control refused the request; ``retry_after`` is a hint in seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
