"""A model's KV footprint per token, read from its headers alone (no weights loaded).

Used at start-up to split the KV memory budget between the target and a draft model that
keeps its own cache over the same block ids. The sizes come from ``check_model_files``: a hostile
file's values are refused there (``ValueError`` naming the file and the key), before any budget
is computed from them.
"""

from __future__ import annotations

from tokenbudget.engine.loader import check_model_files


def kv_elements_per_token(model: str) -> int:
    """``layers * kv_heads * head_dim`` (times 2 for K and V is left to the caller)."""
    return check_model_files(model).kv_elements_per_token
