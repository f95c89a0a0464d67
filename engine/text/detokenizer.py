"""Incremental detokenization and stop strings for one request.

Text is finalized with two offsets into the token list (the approach of vLLM's
``detokenize_incrementally``, written afresh here): ``prefix_offset`` .. ``read_offset`` is a short
window of tokens whose text was already emitted, kept so that decoders that depend on context
(SentencePiece's leading space, byte-level merges) see it; each call decodes only
``tokens[prefix_offset:]`` and emits what extends past the window's text. When the decoded tail
ends with U+FFFD (a multi-byte UTF-8 character split across tokens), the text up to the last
complete character is emitted and the (at most 3) tokens of the incomplete tail are held back
until the character completes. Once more than :data:`MAX_HELD_TOKENS` tokens are pending the
replacement character is genuine (the model produced invalid bytes) and is emitted, which keeps
every call O(new tokens).

Stop strings: :meth:`IncrementalDetokenizer.check_stop` scans only the text added since the
last check (plus ``len(longest stop) - 1`` characters of overlap) and, on a match, truncates
``output_text``. For streaming, :meth:`IncrementalDetokenizer.stream_delta` returns the text not
yet streamed, holding back a tail that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenbudget.engine.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "INITIAL_CONTEXT_TOKENS", "MAX_HELD_TOKENS"]

INITIAL_CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first output token
MAX_HELD_TOKENS = 4  # a held-back incomplete character never needs more tokens than this
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output tokens into text, one step's tokens at a time.

    ``output_text`` (the text of the output tokens so far, possibly truncated at a stop string) is
    safe to read at any time; it lags the tokens only by a held-back incomplete character.
    """

    __slots__ = ("_tok", "_skip", "_ids", "_prefix_offset", "_read_offset", "output_text",
                 "_checked_len", "_streamed_len", "_stopped")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self._checked_len = 0  # output_text[:_checked_len] has been searched for stop strings
        self._streamed_len = 0
        self._stopped = False

    def __copy__(self) -> IncrementalDetokenizer:
        """An independent detokenizer at the same text: part of the output record's copy
        (``engine.core.request_state``), so a step's text lives in the step's own record."""
        other = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        other._ids = list(self._ids)
        return other

    @property
    def num_pending_tokens(self) -> int:
        """Tokens added but whose text is held back (incomplete UTF-8 character)."""
        return len(self._ids) - self._read_offset

    def add_tokens(self, new_token_ids: Iterable[int]) -> str:
        """Append output tokens; return the newly finalized text (may be ``""``).

        Tokens are taken one at a time, so the text is a function of the token sequence alone,
        not of how steps grouped it: where invalid bytes meet a held-back character, the number
        of U+FFFD would otherwise depend on the grouping, and a DELTA stream, a CUMULATIVE one and
        a FINAL_ONLY output (detokenized at the end) could disagree. After a stop string matched
        (``check_stop``), further tokens are ignored.
        """
        pieces = [self._add_one(t) for t in new_token_ids]
        return "".join(pieces)

    def _add_one(self, token_id: int) -> str:
        if self._stopped:
            return ""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        end = len(self._ids)
        if full_text.endswith(_REPLACEMENT):
            end, full_text = self._complete_prefix(full_text)
        delta = full_text[len(prefix_text):]
        if not delta and self.num_pending_tokens <= MAX_HELD_TOKENS:
            return ""  # incomplete character or skipped special tokens: keep them pending
        # The tokens just finalized become the context window of the next call.
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._trim_window()
        self.output_text += delta
        return delta

    def _complete_prefix(self, full_text: str) -> tuple[int, str]:
        """Longest decodable prefix when the tail ends with U+FFFD: ``(token end, its text)``.

        An incomplete UTF-8 character has at most 3 bytes, so it lies within the last 3 tokens;
        drop up to 3 tail tokens until the text no longer ends with U+FFFD. If that fails, the
        replacement character is genuine once more than MAX_HELD_TOKENS tokens are pending
        (emit everything), else hold everything.
        """
        n = len(self._ids)
        for k in range(1, min(3, n - self._read_offset) + 1):
            text = self._tok.decode(self._ids[self._prefix_offset:n - k], self._skip)
            if not text.endswith(_REPLACEMENT):
                return n - k, text
        if self.num_pending_tokens > MAX_HELD_TOKENS:
            return n, full_text
        return self._read_offset, ""

    def _trim_window(self) -> None:
        """Drop ids before the context window so memory stays O(window)."""
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def check_stop(self, stop: Sequence[str],
                   include_stop_str_in_output: bool = False) -> tuple[str | None, int]:
        """Search the newly added text for a stop string.

        Returns ``(matched_stop, truncate_to)``: on a match, ``output_text`` has been truncated to
        ``truncate_to`` characters (before the stop string, or just after it when
        ``include_stop_str_in_output``) and later ``add_tokens`` calls are ignored; without a
        match, ``(None, -1)``. The earliest occurrence wins; among stop strings starting at the
        same position, the first listed.
        """
        if self._stopped or not stop:
            self._checked_len = len(self.output_text)
            return None, -1
        longest = max(len(s) for s in stop)
        start = max(0, self._checked_len - longest + 1)
        best: tuple[int, int, str] | None = None
        for order, s in enumerate(stop):
            if not s:
                continue
            pos = self.output_text.find(s, start)
            if pos != -1 and (best is None or (pos, order) < best[:2]):
                best = (pos, order, s)
        self._checked_len = len(self.output_text)
        if best is None:
            return None, -1
        pos, _, matched = best
        truncate_to = pos + len(matched) if include_stop_str_in_output else pos
        self.output_text = self.output_text[:truncate_to]
        self._checked_len = min(self._checked_len, truncate_to)
        self._stopped = True
        return matched, truncate_to

    def stream_delta(self, finished: bool = False, stop: Sequence[str] = ()) -> str:
        """Text not yet returned by this method (for streaming outputs).

        While not ``finished``, the last ``len(longest stop) - 1`` characters are held back,
        since they could be the start of a stop string that must not be shown.
        """
        end = len(self.output_text)
        if not finished and stop and not self._stopped:
            end -= max(len(s) for s in stop) - 1
        end = min(max(end, self._streamed_len), len(self.output_text))
        delta = self.output_text[self._streamed_len:end]
        self._streamed_len = end
        return delta
