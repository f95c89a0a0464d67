"""Build a :class:`engine.text.tokenizer.Tokenizer` from GGUF ``tokenizer.*`` metadata, tokenizing as
llama.cpp's ``llama-vocab.cpp`` does for the same file.

``tokenizer.ggml.model``:
- ``"gpt2"``: byte-level BPE (``tokens`` + ``merges``), split first by the regex of the
  pre-tokenizer named in ``tokenizer.ggml.pre`` (the one the merges were learned with).
- ``"llama"``: SentencePiece BPE (``tokens`` + ``scores``, byte-fallback ``<0xNN>`` tokens, ``▁`` for
  spaces, a space prefix unless ``add_space_prefix`` is false): encoded by ``spm.SentencePieceText``.

Pre-tokenizers (``tokenizer.ggml.pre``; each name as llama.cpp maps it, :data:`PRE_TOKENIZERS`):
- GPT-2's regex: ``gpt-2``, ``phi-2``, ``olmo``, ``mpt``;
- every digit alone, then GPT-2's regex: ``smollm``, ``starcoder``, ``refact`` (Granite 3),
  ``command-r``, ``codeshell``, ``exaone``, ``minerva-7b``;
- the Llama 3 / cl100k regex (digits in runs of up to 3): ``llama-bpe`` / ``llama3`` / ``llama-v3`` /
  ``falcon3`` (whole words found in the vocabulary are not merged: llama.cpp's ``ignore_merges``;
  BOS added unless ``add_bos_token`` says otherwise),
  ``dbrx`` (OLMo 2, Phi-4) and ``smaug-bpe``;
- the Qwen2 regex (single digits): ``qwen2`` (Qwen2/2.5/3) and ``deepseek-r1-qwen`` after NFC, as
  Qwen's tokenizer.json composes the text (llama.cpp does not), ``stablelm2``, ``megrez``;
- the o200k regex: ``gpt-4o`` (Phi-4-mini), ``llama4``.
Any other name, or none, is a ``ValueError`` naming ``tokenizer.ggml.pre``: a different split gives
different tokens for the same text, silently.

Token types (``tokenizer.ggml.token_type``): CONTROL tokens, the unknown token and the bos/eos/eot/eom
tokens are special (matched whole in the text, skipped by ``decode(skip_special_tokens=True)``);
USER_DEFINED tokens are matched whole but are text. Stop tokens: eos, eot and eom, plus every token
whose text is one of llama.cpp's end-of-generation markers (:data:`END_OF_GENERATION`), as llama.cpp
finds them when a converter left the ids out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tokenbudget.engine.text.spm import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
    SentencePieceText,
)
from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["build_gguf_tokenizer", "PRE_TOKENIZERS", "END_OF_GENERATION"]

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2, _DIGITS = "gpt2", "digits"  # splits made by tokenizers' own ByteLevel / Digits pre-tokenizers


class PreTokenizer(NamedTuple):
    split: str  # a regex, or _GPT2 / _DIGITS
    ignore_merges: bool = False  # a word found whole in the vocabulary is one token (llama.cpp's ignore_merges)
    add_bos: bool = False  # llama.cpp's add_bos when tokenizer.ggml.add_bos_token is absent
    nfc: bool = False  # the model's tokenizer.json composes the text first (Qwen's NFC normalizer)


# tokenizer.ggml.pre -> how llama-vocab.cpp (and the model's tokenizer.json) split the text
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "phi-2", "olmo", "mpt"), PreTokenizer(_GPT2)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    PreTokenizer(_DIGITS)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3"),
                    PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer(_LLAMA3_SPLIT)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), PreTokenizer(_QWEN2_SPLIT, nfc=True)),
    **dict.fromkeys(("stablelm2", "megrez"), PreTokenizer(_QWEN2_SPLIT)),
    **dict.fromkeys(("gpt-4o", "llama4"), PreTokenizer(_O200K_SPLIT)),
}

# llama.cpp's end-of-generation token texts (llama-vocab.cpp) for the families this engine runs
END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<|end_of_text|>", "<EOT>")

# Phi-3's chat tokens swallow the whitespace after them (its tokenizer.json: rstrip), all but these;
# llama.cpp applies the same rule to the architecture.
_PHI3_NO_RSTRIP = frozenset({"<unk>", "<s>", "<|endoftext|>"})


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split = PRE_TOKENIZERS[pre].split
    if split == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre={pre!r} is not a supported pre-tokenizer (supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}); re-convert the model with a recent llama.cpp")
    merges = _strings(meta, "tokenizer.ggml.merges", required=False)
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise ValueError(f"tokenizer.ggml.merges: {m!r} is not two tokens separated by a space")
        pairs.append((left, right))
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=PRE_TOKENIZERS[pre].ignore_merges))
    if PRE_TOKENIZERS[pre].nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_vocab(tokens: list[str], unk: str | None, add_space: bool) -> HFTokenizer:
    """The vocabulary and decoder of a SentencePiece model (what ``decode``, llguidance and the
    server's byte bound read); encoding goes through ``SentencePieceText``, never through this."""
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _strings(meta: dict[str, Any], key: str, required: bool = True) -> list[str]:
    value = meta.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or (required and not value):
        raise ValueError(f"{key} must be a non-empty array of strings, got {type(value).__name__}")
    if not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be an array of strings")
    return list(value)


def _numbers(meta: dict[str, Any], key: str, n: int, default: float) -> list:
    value = meta.get(key)
    if value is None:
        return [default] * n
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) < n:
        raise ValueError(f"{key} must be an array of at least {n} numbers (one per token)")
    return list(value)[:n]


def _token_id(meta: dict[str, Any], name: str, n: int) -> int | None:
    key = f"tokenizer.ggml.{name}_token_id"
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise ValueError(f"{key}={value!r} is not a token id of the {n}-token vocabulary")
    return value


def _special_ids(meta: dict[str, Any], kind: str, tokens: list[str]) -> dict[str, int | None]:
    """bos/eos/eot/eom/unknown ids; a SentencePiece vocabulary that names none has llama.cpp's
    defaults (unknown 0, bos 1, eos 2)."""
    n = len(tokens)
    ids = {name: _token_id(meta, name, n) for name in ("bos", "eos", "eot", "eom", "unknown")}
    if kind == "llama":
        for name, default in (("unknown", 0), ("bos", 1), ("eos", 2)):
            if f"tokenizer.ggml.{name}_token_id" not in meta and default < n:
                ids[name] = default
    return ids


def build_gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Build a :class:`Tokenizer` from decoded GGUF metadata (``{key: python value}``).

    Raises ``NotImplementedError`` for a ``tokenizer.ggml.model`` other than gpt2/llama and
    ``ValueError`` naming the key for a missing or malformed one.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
    tokens = _strings(meta, "tokenizer.ggml.tokens")
    n = len(tokens)
    types = [int(t) for t in _numbers(meta, "tokenizer.ggml.token_type", n, TOKEN_TYPE_NORMAL)]
    ids = _special_ids(meta, kind, tokens)
    end_ids = sorted({i for k in ("eos", "eot", "eom") if (i := ids[k]) is not None}
                     | {i for i, t in enumerate(tokens) if t in END_OF_GENERATION})
    special_types = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN) if kind == "llama" else (TOKEN_TYPE_CONTROL,)
    special = {i for i, ty in enumerate(types) if ty in special_types}
    special |= {i for i in (ids["bos"], *end_ids) if i is not None}
    user = {i for i, ty in enumerate(types) if ty == TOKEN_TYPE_USER_DEFINED} - special
    pre = PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre"))
    add = {"bos": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or (pre is not None and pre.add_bos))),
           "eos": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for name, on in add.items():
        if on and ids[name] is None:
            raise ValueError(f"tokenizer.ggml.add_{name}_token is true but tokenizer.ggml.{name}_token_id is not set")
    wrap = {k: tokens[ids[k]] for k in ("bos", "eos") if add[k]}  # what add_special_tokens=True adds

    encoder = None
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        if wrap:
            template = " ".join(t for t in (wrap.get("bos"), "$A", wrap.get("eos")) if t)
            backend.post_processor = processors.TemplateProcessing(
                single=template, special_tokens=[(t, ids[k]) for k, t in wrap.items()])
    else:
        add_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        unk = ids["unknown"]
        backend = _sentencepiece_vocab(tokens, tokens[unk] if unk is not None else None, add_space)
        rstrip = ({tokens[i] for i in special | user} - _PHI3_NO_RSTRIP
                  if meta.get("general.architecture") == "phi3" else set())
        encoder = SentencePieceText(
            tokens, _numbers(meta, "tokenizer.ggml.scores", n, 0.0), types, unk_id=unk,
            specials={tokens[i]: i for i in sorted(special | user)}, rstrip=rstrip, add_space_prefix=add_space,
            bos_id=ids["bos"] if add["bos"] else None, eos_id=ids["eos"] if add["eos"] else None)
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user)])
    return Tokenizer(backend, bos_token=tokens[ids["bos"]] if ids["bos"] is not None else None,
                     eos_token=tokens[ids["eos"]] if ids["eos"] is not None else None,
                     chat_template=meta.get("tokenizer.chat_template"),
                     extra_eos_token_ids=end_ids, encoder=encoder)
