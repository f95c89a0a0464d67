"""``RequestFault``: the step contract's word for "this fault belongs to these requests".

A step can fail for two kinds of reasons, and the engine must tell them apart:

* a **request fault** belongs to one request: its grammar (a mask it cannot compute, a token it
  refuses), its logits processors, its sampling parameters (a row in which no token is allowed).
  Whatever part of the step finds it (the core computing grammar masks after ``schedule()``, row
  preparation, the grammar consuming the step's tokens) raises ``RequestFault`` naming the
  requests and a short reason. The engine rolls the step back, ends exactly those requests with
  ``finish_reason="error"`` and steps the others again. A request fault NEVER counts towards
  ``max_failed_steps``: it cannot kill the engine, however many requests carry one;
* an **engine fault** is any other exception (model, kernel, a bug): retried, isolated by halving,
  and counted towards killing the engine (``engine.core.engine_core``).

So a request that an attacker shapes to fail (a pathological grammar, ``n`` children that all
fail) ends alone; only faults that every request hits can stop the engine.
"""

from __future__ import annotations

MAX_REASON_CHARS = 300  # a reason is logged and returned to the client: keep it short


def short(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` cut to ``limit`` characters (an error never quotes a whole input back)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class RequestFault(Exception):
    """The step failed because of the requests in ``reasons`` (request id -> short reason)."""

    def __init__(self, reasons: dict[str, str]) -> None:
        if not reasons:
            raise ValueError("a RequestFault names at least one request")
        self.reasons = {rid: short(reason) for rid, reason in reasons.items()}
        super().__init__("; ".join(f"{rid}: {reason}" for rid, reason in self.reasons.items()))
