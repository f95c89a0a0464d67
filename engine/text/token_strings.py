"""A logprob token's string (``Logprob.decoded_token``), as vLLM gives it.

A token decoded alone is its text, special tokens kept. A token that holds only part of a
multi-byte UTF-8 character (byte-fallback and byte-level vocabularies split "你" into up to 4
tokens) decodes alone to U+FFFD; vLLM (``LogprobsProcessor._correct_decoded_token``) decodes it
after the 1..4 tokens sampled before it instead: the token that completes the character gets the
whole character (the bytes of the earlier parts included), and a token whose character is not
complete yet gets ``""``. So the strings of a sequence's tokens join to its text, and each
token's ``bytes`` (its string's UTF-8) join to the text's bytes. The top-k alternatives at a
position are each read after the same sampled tokens, never after each other.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"
MAX_CONTEXT = 4  # a UTF-8 character has at most 4 bytes, so at most 4 tokens


def token_string(tokenizer, token_id: int, context: Sequence[int]) -> str:
    """``token_id``'s string after the sampled tokens ``context`` (oldest first; only the last
    ``MAX_CONTEXT`` are read)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if not text.endswith(_REPLACEMENT):
        return text
    context = list(context[-MAX_CONTEXT:])
    for n in range(1, len(context) + 1):
        before = context[-n:]
        joined = tokenizer.decode(before + [token_id], skip_special_tokens=False)
        if joined.endswith(_REPLACEMENT):
            continue  # the character is not complete with this much context: try more
        # the tokens just before that were themselves part of this character gave "" (not
        # complete then); their bytes belong to this token's string
        clean = len(before)
        while clean > 0 and tokenizer.decode([before[clean - 1]], skip_special_tokens=False).endswith(_REPLACEMENT):
            clean -= 1
        prefix = tokenizer.decode(before[:clean], skip_special_tokens=False) if clean else ""
        if joined.startswith(prefix):
            return joined[len(prefix):]
        common = 0
        for a, b in zip(prefix, joined):
            if a != b:
                break
            common += 1
        return joined[common:]
    return ""  # not complete yet: the token that completes the character carries it
