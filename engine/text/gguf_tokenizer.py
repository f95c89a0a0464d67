"""Build a :class:`engine.text.tokenizer.Tokenizer` from GGUF ``tokenizer.*`` metadata.

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: ``tokens`` + ``merges``; the
``pre`` key picks the split regex the merges were learned with, as llama.cpp's
``llama-vocab.cpp`` does) and ``"llama"`` (SentencePiece-BPE, rebuilt as a byte-fallback BPE
whose merges are recovered from the token scores, as transformers' converter does).

Pre-tokenizers (``tokenizer.ggml.pre``):
- ``smollm``, ``starcoder``, ``refact``, ``codeshell``...: every digit alone, then the GPT-2 regex
  (Hugging Face SmolLM2's ``tokenizer.json``: ``Digits(individual_digits=True)`` + ``ByteLevel``;
  llama.cpp: ``\\p{N}`` then the GPT-2 regex).
- ``llama-bpe`` / ``llama3`` / ``smaug-bpe`` / ``dbrx`` / ``falcon3``: the Llama-3 regex.
- ``qwen2`` / ``deepseek-r1-qwen``: the Qwen2 regex (single digits).
- ``default`` / ``gpt2`` / missing: the GPT-2 regex. Anything else falls back to it with a warning.

Token types (``tokenizer.ggml.token_type``): 3 (CONTROL) becomes a special added token (skipped
by ``decode(skip_special_tokens=True)``), 4 (USER_DEFINED) a non-special added token.
"""

from __future__ import annotations

import warnings
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["build_gguf_tokenizer"]

TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL = 1, 2, 3
TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE = 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"}
_GPT2 = {"default", "gpt2", "gpt-2", ""}
_REGEX_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in _GPT2:
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known; using the GPT-2 split regex",
                      stacklevel=3)
    return byte_level


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                     ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3"))
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_merges(tokens: list[str], scores: list[float],
                          types: list[int]) -> list[tuple[str, str]]:
    """Recover BPE merges from SentencePiece scores: merges of higher-scored pieces first."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED)}
    found: list[tuple[float, int, int, tuple[str, str]]] = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[pid], vocab[left], vocab[right], (left, right)))
    found.sort()
    return [pair for *_, pair in found]


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> HFTokenizer:
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=vocab, merges=_sentencepiece_merges(tokens, scores, types),
                     unk_token=tokens[unk_id] if unk_id is not None else None,
                     fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(bpe)
    add_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_special_tokens(tok: HFTokenizer, tokens: list[str], types: list[int],
                        force_special: set[int]) -> None:
    special, user = [], []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == TOKEN_TYPE_CONTROL or i in force_special:
            special.append(AddedToken(t, special=True, normalized=False))
        elif ty == TOKEN_TYPE_USER_DEFINED:
            user.append(AddedToken(t, special=False, normalized=False))
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def build_gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Build a :class:`Tokenizer` from decoded GGUF metadata (``{key: python value}``).

    Raises ``NotImplementedError`` for a ``tokenizer.ggml.model`` other than gpt2/llama and
    ``ValueError`` when the token list is missing.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens; cannot build a tokenizer")
    tokens = list(tokens)
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
    if kind == "gpt2":
        tok = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta, tokens, types)
    else:
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")

    def _tok(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = _tok("bos"), _tok("eos")
    eos_like = {int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                       "tokenizer.ggml.eom_token_id") if k in meta}
    bos_ids = {int(meta["tokenizer.ggml.bos_token_id"])} if bos is not None else set()
    _add_special_tokens(tok, tokens, types, eos_like | bos_ids)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos is not None:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return Tokenizer(tok, bos_token=bos, eos_token=eos,
                     chat_template=meta.get("tokenizer.chat_template"),
                     extra_eos_token_ids=sorted(eos_like))
