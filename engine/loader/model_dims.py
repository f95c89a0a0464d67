"""A model file's sizes, read from its metadata (GGUF) or ``config.json`` (HF) and bounded.

:class:`ModelDims` holds the sizes every family shares (hidden, vocab, layers, heads, KV heads,
head dims, FFN width, context, rotary width), each a :class:`Dim` that remembers which key it
came from, so a later disagreement with a tensor names the key and both numbers.

Every value is checked here before anything is sized from it: an integer (not a bool, a float or
a string), positive and below ``2**31``; a head dimension even and at most ``MAX_HEAD_DIM``
(no model exceeds 512); ``heads`` a multiple of ``kv_heads``; the context in ``[1, 2**31)``;
norm epsilons and RoPE bases finite and positive; the BOS/EOS ids inside the vocabulary. A
bad value is a ``ValueError`` naming the file and the key. Files are untrusted: a metadata value
of ``2**40`` must fail here, not in an allocation of that size.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["Dim", "ModelDims", "MAX_HEAD_DIM", "MAX_SIZE", "gguf_model_dims", "hf_model_dims"]

MAX_SIZE = 2**31          # every size and the context length are below this
MAX_HEAD_DIM = 1024       # the largest head dimension accepted (Gemma's 256 is the largest in use)
_DEFAULT_CONTEXT = 2048   # what the loaders assume when a file does not say


class Dim(NamedTuple):
    value: int
    key: str     # the key it was read from, or the keys it was derived from ("a / b")
    source: str  # how it was read: "llama.attention.head_count = 9"


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The shared sizes of a model, each with its source (see module doc)."""

    hidden: Dim
    vocab: Dim
    layers: Dim
    heads: Dim
    kv_heads: Dim
    head_dim: Dim
    v_head_dim: Dim
    ffn: Dim
    context: Dim
    rope_dim: Dim  # rotary dimensions per head (== head_dim unless partial rotary)

    @property
    def kv_elements_per_token(self) -> int:
        """``layers * kv_heads * head_dim`` (K or V, one token)."""
        return self.layers.value * self.kv_heads.value * self.head_dim.value


class _Values:
    """Typed, bounded reads of one mapping (GGUF metadata or config.json) of one file."""

    def __init__(self, values: dict[str, Any], path: str) -> None:
        self.values, self.path = values, path

    def fail(self, key: str, message: str) -> ValueError:
        return ValueError(f"{self.path}: {key} {message}")

    def size(self, key: str, default: Dim | None = None, hi: int = MAX_SIZE) -> Dim:
        """A positive integer below ``hi``; ``default`` when the key is absent (or null)."""
        value = self.values.get(key)
        if value is None:
            if default is None:
                raise self.fail(key, "is missing")
            return default
        if type(value) is not int:
            raise self.fail(key, f"must be an integer, got {type(value).__name__} {_short(value)}")
        if not 1 <= value < hi:
            raise self.fail(key, f"= {value} is out of range (1 to {hi - 1})")
        return Dim(value, key, f"{key} = {value}")

    def positive_float(self, key: str) -> None:
        """Absent, or a finite positive number."""
        value = self.values.get(key)
        if value is None:
            return
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise self.fail(key, f"must be a finite positive number, got {_short(value)}")

    def token_ids(self, key: str, vocab: Dim) -> None:
        """Absent, or an id (or list of ids) inside the vocabulary."""
        value = self.values.get(key)
        for i in value if isinstance(value, list) else [] if value is None else [value]:
            if type(i) is not int or not 0 <= i < vocab.value:
                raise self.fail(key, f"= {_short(value)} is not a token id below the vocabulary size "
                                     f"{vocab.value} ({vocab.source})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _head_dims(v: _Values, hidden: Dim, heads: Dim, kv_heads: Dim, head_dim: Dim | None,
               v_head_dim_key: str | None) -> tuple[Dim, Dim]:
    """``head_dim`` (given, or hidden / heads) and the value head dim, both bounded."""
    if kv_heads.value > heads.value or heads.value % kv_heads.value:
        raise v.fail(kv_heads.key, f"= {kv_heads.value} does not divide the {heads.value} attention heads "
                                   f"({heads.source})")
    if head_dim is None:
        if hidden.value % heads.value:
            raise v.fail(heads.key, f"= {heads.value} does not divide the hidden size {hidden.value} "
                                    f"({hidden.source})")
        key = f"{hidden.key} / {heads.key}"
        head_dim = Dim(hidden.value // heads.value, key,
                       f"{key} = {hidden.value} / {heads.value} = {hidden.value // heads.value}")
    v_head_dim = v.size(v_head_dim_key, head_dim) if v_head_dim_key else head_dim
    for dim in (head_dim, v_head_dim):
        if dim.value % 2 or dim.value > MAX_HEAD_DIM:
            raise v.fail(dim.key, f"gives a head dimension of {dim.value}, which must be even and at most "
                                  f"{MAX_HEAD_DIM} ({dim.source})")
    return head_dim, v_head_dim


def _rope_dim(v: _Values, key: str, head_dim: Dim) -> Dim:
    rope = v.size(key, head_dim)
    if rope.value % 2 or rope.value > head_dim.value:
        raise v.fail(key, f"= {rope.value} rotary dimensions: must be even and at most the head dimension "
                          f"{head_dim.value} ({head_dim.source})")
    return rope


def gguf_model_dims(meta: dict[str, Any], embedding_rows: int | None, path: str) -> ModelDims:
    """Sizes from GGUF metadata (llama.cpp's ``<arch>.*`` keys). ``vocab`` is the length of
    ``tokenizer.ggml.tokens``, or ``embedding_rows`` (``token_embd``'s rows) when there is no
    token list. Also checks the types of the tokenizer arrays and the special token ids."""
    v = _Values(meta, path)
    arch = meta.get("general.architecture")
    if type(arch) is not str or not arch:
        raise v.fail("general.architecture", f"must be a non-empty string, got {_short(arch)}")
    p = f"{arch}."
    hidden, heads = v.size(p + "embedding_length"), v.size(p + "attention.head_count")
    kv_heads = v.size(p + "attention.head_count_kv", heads)
    key_length = v.size(p + "attention.key_length") if meta.get(p + "attention.key_length") is not None else None
    head_dim, v_head_dim = _head_dims(v, hidden, heads, kv_heads, key_length, p + "attention.value_length")
    vocab = _gguf_vocab(v, embedding_rows)
    for key in ("bos", "eos", "eot", "eom"):  # the ids the engine uses (llama.cpp only warns on others)
        v.token_ids(f"tokenizer.ggml.{key}_token_id", vocab)
    for key in (p + "attention.layer_norm_rms_epsilon", p + "attention.layer_norm_epsilon", p + "rope.freq_base"):
        v.positive_float(key)
    return ModelDims(hidden=hidden, vocab=vocab, layers=v.size(p + "block_count"), heads=heads,
                     kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                     ffn=v.size(p + "feed_forward_length"),
                     context=v.size(p + "context_length", Dim(_DEFAULT_CONTEXT, "context", "the default context")),
                     rope_dim=_rope_dim(v, p + "rope.dimension_count", head_dim))


_TOKEN_ARRAYS = (("tokenizer.ggml.tokens", str), ("tokenizer.ggml.token_type", int),
                 ("tokenizer.ggml.scores", float), ("tokenizer.ggml.merges", str))


def _gguf_vocab(v: _Values, embedding_rows: int | None) -> Dim:
    """The vocabulary size, after checking each tokenizer array's type (and length)."""
    tokens = v.values.get("tokenizer.ggml.tokens")
    for key, kind in _TOKEN_ARRAYS:
        values = v.values.get(key)
        if values is None:
            continue
        if not isinstance(values, list) or (values and type(values[0]) is not kind):
            raise v.fail(key, f"must be an array of {kind.__name__}")
        if key != "tokenizer.ggml.merges" and tokens is not None and len(values) != len(tokens):
            raise v.fail(key, f"has {len(values)} entries, tokenizer.ggml.tokens has {len(tokens)}")
    if tokens is not None:
        if not 1 <= len(tokens) < MAX_SIZE:
            raise v.fail("tokenizer.ggml.tokens", f"has {len(tokens)} entries (1 to {MAX_SIZE - 1} allowed)")
        return Dim(len(tokens), "tokenizer.ggml.tokens", f"tokenizer.ggml.tokens has {len(tokens)} entries")
    if embedding_rows is None:
        raise v.fail("tokenizer.ggml.tokens", "is missing (and there is no token_embd.weight)")
    return Dim(embedding_rows, "token_embd.weight", f"token_embd.weight has {embedding_rows} rows")


def hf_model_dims(cfg: dict[str, Any], path: str, generation: Any = None) -> ModelDims:
    """Sizes from a parsed ``config.json`` (transformers' keys; a multimodal checkpoint's text
    part), every value checked (module doc); ``generation``: the parsed
    ``generation_config.json``, whose EOS ids are checked too."""
    v = _Values(cfg, path)
    hidden, heads = v.size("hidden_size"), v.size("num_attention_heads")
    kv_heads = v.size("num_key_value_heads", heads)
    given = v.size("head_dim") if cfg.get("head_dim") is not None else None
    head_dim, v_head_dim = _head_dims(v, hidden, heads, kv_heads, given, None)
    vocab = v.size("vocab_size")
    v.token_ids("bos_token_id", vocab)
    v.token_ids("eos_token_id", vocab)
    if generation is not None:
        if not isinstance(generation, dict):
            raise ValueError(f"{path}: generation_config.json must hold a JSON object")
        _Values(generation, os.path.join(path, "generation_config.json")).token_ids("eos_token_id", vocab)
    v.positive_float("rms_norm_eps")
    v.positive_float("rope_theta")
    if not isinstance(cfg.get("tie_word_embeddings", False), bool):
        raise v.fail("tie_word_embeddings", f"must be true or false, got {_short(cfg['tie_word_embeddings'])}")
    if not isinstance(cfg.get("rope_scaling") or {}, dict) or not isinstance(cfg.get("rope_parameters") or {}, dict):
        raise v.fail("rope_scaling", "(or rope_parameters) must be an object or null")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    rotary = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))  # 5.x, else 4.x spelling
    rotary = 1.0 if rotary is None else rotary
    if type(rotary) not in (int, float) or not 0 < rotary <= 1:
        raise v.fail("partial_rotary_factor", f"must be in (0, 1], got {_short(rotary)}")
    rope_dim = int(head_dim.value * rotary)
    rope = Dim(rope_dim, "partial_rotary_factor",
               f"{head_dim.key} * partial_rotary_factor = {head_dim.value} * {rotary} = {rope_dim}")
    if rope_dim % 2 or rope_dim < 2:
        raise v.fail("partial_rotary_factor", f"gives {rope_dim} rotary dimensions per head, which must be even")
    return ModelDims(hidden=hidden, vocab=vocab, layers=v.size("num_hidden_layers"), heads=heads,
                     kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                     ffn=v.size("intermediate_size"),
                     context=v.size("max_position_embeddings", Dim(_DEFAULT_CONTEXT, "context", "the default context")),
                     rope_dim=rope)
