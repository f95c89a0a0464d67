"""The GGUF tokenizer's pre-splits, pinned per ``tokenizer.ggml.pre`` family (issue 43: only
SmolLM2's was tested; ``\\p{N}{1,3}`` -> ``\\p{N}+`` in the Llama 3 regex passed the suite).

The expected pieces are written out by hand from each family's documented rule (llama.cpp's
llama-vocab.cpp and the models' tokenizer.json): Llama 3 / cl100k cuts digit runs into threes and
matches contractions case-insensitively; Qwen2 splits every digit; GPT-2's regex keeps a digit
run whole with its leading space and matches contractions in lower case only; SmolLM2 splits
every digit, then GPT-2's regex. Then each piece is mapped to byte-level characters (``Ġ`` for a
space), as the pre-tokenizer's output is."""

from __future__ import annotations

import pytest
from tokenizers import pre_tokenizers

from tokenbudget.engine.text.gguf_tokenizer import _pre_tokenizer

CASES = {
    "In 2024, 12345 people": {
        "llama-bpe": ["In", " ", "202", "4", ",", " ", "123", "45", " people"],
        "qwen2": ["In", " ", "2", "0", "2", "4", ",", " ", "1", "2", "3", "4", "5", " people"],
        "gpt-2": ["In", " 2024", ",", " 12345", " people"],
        "smollm": ["In", " ", "2", "0", "2", "4", ",", " ", "1", "2", "3", "4", "5", " people"],
    },
    "I'M here, they'll go": {
        "llama-bpe": ["I", "'M", " here", ",", " they", "'ll", " go"],
        "qwen2": ["I", "'M", " here", ",", " they", "'ll", " go"],
        "gpt-2": ["I", "'", "M", " here", ",", " they", "'ll", " go"],
        "smollm": ["I", "'", "M", " here", ",", " they", "'ll", " go"],
    },
    "a  \n\n  b": {
        "llama-bpe": ["a", "  \n\n", " ", " b"],
        "qwen2": ["a", "  \n\n", " ", " b"],
        "gpt-2": ["a", "  \n\n ", " b"],
        "smollm": ["a", "  \n\n ", " b"],
    },
    "你好世界 1234567": {
        "llama-bpe": ["你好世界", " ", "123", "456", "7"],
        "qwen2": ["你好世界", " ", "1", "2", "3", "4", "5", "6", "7"],
        "gpt-2": ["你好世界", " 1234567"],
        "smollm": ["你好世界", " ", "1", "2", "3", "4", "5", "6", "7"],
    },
    "Hello!!! ...world": {
        "llama-bpe": ["Hello", "!!!", " ...", "world"],
        "qwen2": ["Hello", "!!!", " ...", "world"],
        "gpt-2": ["Hello", "!!!", " ...", "world"],
        "smollm": ["Hello", "!!!", " ...", "world"],
    },
}
_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _byte_level(piece: str) -> str:
    (mapped,) = [p for p, _ in _BYTES.pre_tokenize_str(piece)]
    return mapped


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2", "smollm"])
@pytest.mark.parametrize("text", list(CASES))
def test_each_family_splits_as_documented(pre, text):
    got = [piece for piece, _ in _pre_tokenizer(pre).pre_tokenize_str(text)]
    assert got == [_byte_level(p) for p in CASES[text][pre]]
