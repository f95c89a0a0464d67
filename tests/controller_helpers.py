"""Requests and controllers for the draft-length controller's tests (tests/test_adaptive*.py)."""

from __future__ import annotations

from tokenbudget.scheduler.request import Request
from tokenbudget.spec.adaptive import AdaptiveSpecController


def decoding_requests(n: int, context: int = 2, **kw) -> list[Request]:
    """``n`` requests r0.. with ``context`` tokens computed and one to decode."""
    out = []
    for i in range(n):
        r = Request(f"r{i}", [1] * (context + 1), **kw)
        r.num_computed_tokens = context
        out.append(r)
    return out


def controller(cost, max_k: int = 4, **kw) -> AdaptiveSpecController:
    return AdaptiveSpecController(max_k, cost_model=cost, **kw)
