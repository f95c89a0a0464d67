"""A model's KV footprint per token, read from its config alone (no weights loaded).

Used at start-up to split the KV memory budget between the target and a draft model that
keeps its own cache over the same block ids.
"""

from __future__ import annotations

import json
import os


def kv_elements_per_token(model: str) -> int:
    """``layers * kv_heads * head_dim`` (times 2 for K and V is left to the caller)."""
    if os.path.isdir(model):
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim
    from tokenbudget.engine.loader.gguf_loader import read_gguf_metadata
    meta = read_gguf_metadata(model)
    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length") or int(meta[f"{arch}.embedding_length"]) // heads)
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    return int(meta[f"{arch}.block_count"]) * kv_heads * head_dim
