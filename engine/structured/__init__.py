"""Structured output: grammar-constrained decoding that stays exact under speculation.

``params`` (what users write: ``StructuredOutputsParams``), ``backend`` (the grammar library
behind a small interface; llguidance, chosen by ``benches/structured_backends.py``), ``bitmask``
(a packed token mask onto logits rows) and ``manager`` (per-request grammar state inside the
engine's step transaction: masks for every verify row, advance at commit, rollback on failure).
"""
