"""SentencePiece BPE encoding of one text fragment: the algorithm of sentencepiece's ``bpe_model.cc``
and llama.cpp's ``llm_tokenizer_spm`` (written afresh here), for GGUF ``tokenizer.ggml.model ==
"llama"`` vocabularies (Llama 2, Mistral, Gemma 2/3, Phi-3).

The rule (what the models were trained with):
- the fragment is split into Unicode characters; every adjacent pair whose concatenation is a
  mergeable piece (NORMAL, USER_DEFINED or UNUSED) is a candidate, scored by that piece's score;
- the best candidate is merged (highest score; on equal scores the leftmost), new candidates with
  its neighbours are added, until none is left;
- a symbol that is an UNUSED piece is split back into the two symbols it was merged from (as
  sentencepiece does; the last merge recorded for that text wins, as there);
- a symbol that is no piece (a character outside the vocabulary) becomes its UTF-8 bytes as
  ``<0xNN>`` tokens when the vocabulary has them, else the unknown token, consecutive unknowns
  fused into one (sentencepiece's rule).

Speed (no quadratic step): the text is first cut between two characters that no mergeable piece
holds next to each other (no merge can ever join them, so each part is independent and the result
is the same), parts are memoised, and each part runs the heap algorithm in O(n log n). A 100 KB
prompt of ordinary text costs a few hundred milliseconds; ``benches/spm_tokenizer.py`` measures it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["SentencePieceBPE", "SentencePieceText", "TOKEN_TYPE_NORMAL", "TOKEN_TYPE_UNKNOWN", "TOKEN_TYPE_CONTROL",
           "TOKEN_TYPE_USER_DEFINED", "TOKEN_TYPE_UNUSED", "TOKEN_TYPE_BYTE"]

# llama.cpp's llama_token_type (what GGUF's tokenizer.ggml.token_type holds)
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL = 1, 2, 3
TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE = 4, 5, 6
_MERGEABLE = (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED)
_CACHE_SIZE = 1 << 16  # memoised parts (cleared when full: a part is at most a few words)


class SentencePieceBPE:
    """Encodes text fragments (already escaped: spaces as ``▁``) to token ids; thread-safe."""

    def __init__(self, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                 unk_id: int | None) -> None:
        self._piece: dict[str, int] = {}
        self._score: dict[str, float] = {}
        self._unused: set[str] = set()
        for i, (text, ty) in enumerate(zip(tokens, types)):
            if ty in _MERGEABLE and text not in self._piece:
                self._piece[text] = i
                self._score[text] = float(scores[i])
                if ty == TOKEN_TYPE_UNUSED:
                    self._unused.add(text)
        index = {text: i for i, text in enumerate(tokens)}
        byte_ids = [index.get(f"<0x{b:02X}>") for b in range(256)]
        self._byte_ids: list[int] | None = byte_ids if None not in byte_ids else None
        self._unk_id = unk_id
        # every pair of characters that sits side by side inside some mergeable piece
        self._joinable = {p[k:k + 2] for p in self._piece for k in range(len(p) - 1)}
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (one fragment between special tokens, spaces already ``▁``)."""
        out: list[int] = []
        start, joinable, cache = 0, self._joinable, self._cache
        for k in range(1, len(text) + 1):
            if k < len(text) and text[k - 1:k + 1] in joinable:
                continue
            part = text[start:k]
            ids = cache.get(part)
            if ids is None:
                ids = self._encode_part(part)
                if len(cache) >= _CACHE_SIZE:
                    cache.clear()
                cache[part] = ids
            out.extend(ids)
            start = k
        return self._fuse_unknowns(out)

    # ------------------------------------------------------------------ one independent part

    def _encode_part(self, text: str) -> tuple[int, ...]:
        sym = list(text)  # sym[i] == "" once merged into its left neighbour
        prev = list(range(-1, len(sym) - 1))
        nxt = list(range(1, len(sym) + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, str]] = []
        rev_merge: dict[str, tuple[str, str]] = {}
        score = self._score

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = sym[left] + sym[right]
            s = score.get(merged)
            if s is None:
                return
            heapq.heappush(heap, (-s, left, right, merged))
            if merged in self._unused:
                rev_merge[merged] = (sym[left], sym[right])

        for i in range(len(sym) - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != len(merged):
                continue  # stale: one side was merged away or grew since this pair was pushed
            sym[left], sym[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        ids: list[int] = []
        i = 0
        while i >= 0:
            self._resegment(sym[i], rev_merge, ids)
            i = nxt[i]
        return tuple(ids)

    def _resegment(self, text: str, rev_merge: dict[str, tuple[str, str]], out: list[int]) -> None:
        if text in self._unused and text in rev_merge:
            left, right = rev_merge[text]
            self._resegment(left, rev_merge, out)
            self._resegment(right, rev_merge, out)
            return
        pid = self._piece.get(text)
        if pid is not None:
            out.append(pid)
        elif self._byte_ids is not None:
            out.extend(self._byte_ids[b] for b in text.encode("utf-8"))
        elif self._unk_id is not None:
            out.append(self._unk_id)
        else:
            raise ValueError(f"{text!r} is not in the vocabulary, which has no byte tokens and no "
                             f"tokenizer.ggml.unknown_token_id")

    def _fuse_unknowns(self, ids: list[int]) -> list[int]:
        if self._byte_ids is not None or self._unk_id is None:
            return ids
        unk = self._unk_id
        return [t for k, t in enumerate(ids) if not (t == unk and k and ids[k - 1] == unk)]


class _Splitter:
    """Cuts the given tokens out of a text, leftmost and longest first (``rstrip`` ones take the
    whitespace after them): ``tokenizers``' added-token matcher (Aho-Corasick, linear in the text)
    over a one-entry vocabulary, so each run of text between tokens comes back as one piece."""

    _TEXT = "\x00text"

    def __init__(self, tokens: dict[str, int], rstrip: set[str]) -> None:
        self._hf = HFTokenizer(models.WordLevel({self._TEXT: 0}, unk_token=self._TEXT))
        self._hf.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
                                     for t in tokens])
        self._id = {self._hf.token_to_id(t): i for t, i in tokens.items()}

    def split(self, text: str) -> list[tuple[int | None, str]]:
        """``(token id, "")`` for a token, ``(None, text)`` for the text between."""
        found = self._hf.encode(text, add_special_tokens=False)
        return [(self._id[s], "") if s in self._id else (None, text[a:b])
                for s, (a, b) in zip(found.ids, found.offsets)]


class SentencePieceText:
    """A whole text to token ids, as llama.cpp's ``llama_vocab::tokenize`` for a SentencePiece
    vocabulary with special tokens always parsed: the special and user-defined tokens spelled in the
    text are cut out first (``rstrip`` ones take the whitespace after them), every run of text
    between them gets a leading space when ``add_space_prefix`` and it starts the text or follows
    such a token, spaces become ``▁``, and each run goes through :class:`SentencePieceBPE`;
    ``bos_id`` / ``eos_id`` (when the model adds them) wrap the ids when ``add_special_tokens``.

    User-defined tokens made of spaces (Gemma's whitespace runs, which the converter writes with
    spaces for ``▁``) are matched after the spaces became ``▁``, as sentencepiece matches them: a
    ``▁`` written in the text then counts as a space, which llama.cpp (matching them before) does
    not do.
    """

    def __init__(self, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                 unk_id: int | None, specials: dict[str, int], rstrip: Iterable[str] = (),
                 add_space_prefix: bool = True, bos_id: int | None = None, eos_id: int | None = None) -> None:
        self._bpe = SentencePieceBPE(tokens, scores, types, unk_id)
        self._add_space = add_space_prefix
        self._bos, self._eos = bos_id, eos_id
        spaced = {t.replace(" ", "\u2581"): i for t, i in specials.items() if " " in t}
        self._split = _Splitter({t: i for t, i in specials.items() if " " not in t}, set(rstrip))
        self._split_spaced = _Splitter(spaced, set()) if spaced else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = [self._bos] if add_special_tokens and self._bos is not None else []
        after_special = True
        for tid, run in self._split.split(text) if text else ():
            if tid is not None:
                out.append(tid)
                after_special = True
                continue
            run = (" " + run if self._add_space and after_special else run).replace(" ", "\u2581")
            for sid, part in self._split_spaced.split(run) if self._split_spaced else ((None, run),):
                out.extend(self._bpe.encode(part) if sid is None else (sid,))
            after_special = False
        if add_special_tokens and self._eos is not None:
            out.append(self._eos)
        return out
