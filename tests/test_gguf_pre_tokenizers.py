"""Byte-level BPE vocabularies from GGUF, one per pre-tokenizer the supported families' files carry
(``tokenizer.ggml.pre``), against transformers' tokenizer for the same vocabulary and merges.

For each family a tiny BPE is trained here with the ``tokenizers`` package in the shape of that
family's ``tokenizer.json`` (its split regex or digit rule, Qwen's NFC, Llama 3's
``ignore_merges`` and BOS), saved, loaded by transformers (the reference), and converted to the
metadata llama.cpp's ``convert_hf_to_gguf.py`` writes (``get_vocab_base``: tokens by id, added
tokens CONTROL or USER_DEFINED, merges as ``"a b"``, the ``pre`` name). The training text is full
of digit runs, contractions, whitespace runs and non-ASCII letters, so the vocabulary has the
multi-digit and cross-boundary tokens a wrong regex would reach (``\\p{N}{1,3}`` vs ``\\p{N}+``).
"""

from __future__ import annotations

import functools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spm_fixtures import write_gguf  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tokenbudget.engine.loader.gguf_loader import read_gguf_metadata
from tokenbudget.engine.text.gguf_tokenizer import build_gguf_tokenizer

from tokenizer_corpus import CORPUS, SAMPLES  # noqa: E402

transformers = pytest.importorskip("transformers", reason="needs transformers (the [test] extra)")

# the split regexes as the families' tokenizer.json files spell them (written out again here, so
# that a change to the engine's copy is caught)
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
O200K = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])

# family -> (tokenizer.ggml.pre, split (regex or "digits"), ignore_merges, NFC, BOS token, specials)
FAMILIES = {
    "qwen3": ("qwen2", QWEN2, False, True, None, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]),
    "llama3": ("llama-bpe", LLAMA3, True, False, "<|begin_of_text|>",
               ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "olmo2": ("dbrx", LLAMA3, False, False, None, ["<|endoftext|>", "<|pad|>"]),
    "phi4": ("dbrx", LLAMA3, False, False, None, ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"]),
    "phi4-mini": ("gpt-4o", O200K, False, False, None, ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]),
    "granite": ("refact", "digits", False, False, None, ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"]),
    "gpt2": ("gpt-2", "gpt2", False, False, None, ["<|endoftext|>"]),
}

EXTRA = ["x 1 22 333 4444 55555 666666 7777777 12345678901234567890", "3.14159 2,718 1e-10 0x1F 0o777 ١٢٣٤٥ ⅣⅫ ½",
         "I'M SURE WE'RE DONE, THEY'LL SAY, IT'S BOB'S and 'quoted' don't", "e\u0301 vs é, A\u030a vs Å, ﬁ",
         "   leading\n\n\n  trailing  \t\t\r\n", "CamelCaseWords and snake_case_words and ALLCAPS", "😀😃 🏳️‍🌈 🇯🇵",
         "<|im_start|>user\nhi<|im_end|>", "a\u00a0b\u2009c\u3000d", "path/to/file.py:12:3 // comment",
         "Ünïcödé ΑΒΓ абв אבג 日本語 한국어 ไทย", "a zyzzyva ate 2024 zyzzyvas"]
TEXTS = CORPUS + SAMPLES + EXTRA


@functools.cache
def _corpus() -> list[str]:
    rng = random.Random(1)
    words = ["the", "quick", "brown", "fox", "I'm", "we're", "they'll", "it's", "don't", "naïve", "café", "世界",
             "日本語", "한국어", "Привет", "CamelCase", "snake_case", "ALLCAPS", "x", "foo.bar()", "🎉", "👍🏽"]
    lines = []
    for _ in range(4000):
        parts = [rng.choice(words) if rng.random() < 0.6 else str(rng.randint(0, 10 ** rng.randint(1, 9)))
                 for _ in range(10)]
        lines.append(rng.choice([" ", "  ", ", ", "\n", "\t"]).join(parts) + rng.choice(["", "\n", "!!", "  "]))
    return lines + TEXTS


def _pre_tokenizer(split: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split == "gpt2")
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if split == "gpt2":
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"), byte_level])


def _reference(family: str, path) -> tuple:
    """(transformers' tokenizer, the GGUF metadata llama.cpp writes) for ``family``.

    As in the real vocabularies, some tokens are never produced by the family's own split: the
    Qwen vocabulary is learned with digit runs (Qwen's comes from cl100k) though Qwen splits every
    digit, and Llama 3's has whole words its merges do not reach (``ignore_merges`` finds them).
    """
    pre, split, ignore_merges, nfc, bos, specials = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(LLAMA3 if family == "qwen3" else split)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.pre_tokenizer = _pre_tokenizer(split)
    spec = json.loads(tok.to_str())
    spec["model"]["ignore_merges"] = ignore_merges
    spec["model"]["vocab"]["\u0120zyzzyva"] = max(spec["model"]["vocab"].values()) + 1  # a word no merge reaches
    tok = Tokenizer.from_str(json.dumps(spec))
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(path / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(max(by_id) + 1)]  # the converter pads id gaps
    types = [3 if t in specials else 5 if i not in by_id else 1 for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    meta = {"general.architecture": family, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.eos_token_id": vocab[specials[0]] if bos is None else vocab["<|end_of_text|>"]}
    if bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = vocab[bos]
    return hf, meta


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        hf, meta = _reference(family, path)
        out[family] = (hf, meta, build_gguf_tokenizer(meta))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_merge_applies_as_in_transformers(families, family: str) -> None:
    """The training text uses every merge learned from it: a merge out of its rank shows here."""
    hf, _, ours = families[family]
    lines = _corpus()
    assert [ours.encode(t) for t in lines] == hf(lines, add_special_tokens=False).input_ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_encode_and_decode_like_transformers(families, family: str) -> None:
    hf, _, ours = families[family]
    for text in TEXTS:
        ids = hf(text, add_special_tokens=False).input_ids
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=True) == hf(text).input_ids, text  # Llama 3: BOS
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


_TEXT = st.lists(st.sampled_from(list("0123456789 abcXYZ'.,!?\n\t é世🎉") + ["'s", "'LL", "  ", "１２", "٣"]),
                 max_size=30).map("".join)


@settings(max_examples=80, deadline=None)
@given(text=_TEXT | st.text(st.characters(exclude_categories=("Cs",)), max_size=30))
@pytest.mark.parametrize("family", ["qwen3", "llama3", "olmo2", "phi4-mini", "granite"])
def test_encode_property_like_transformers(families, family: str, text: str) -> None:
    hf, _, ours = families[family]
    assert ours.encode(text) == hf(text, add_special_tokens=False).input_ids


def test_digit_runs_split_as_each_family(families) -> None:
    """The families differ exactly here: Llama 3 / cl100k / o200k cut digit runs in threes, Qwen
    splits every digit, Granite (starcoder) too, GPT-2 keeps the run whole."""
    runs = {f: [families[f][2].decode([i]) for i in families[f][2].encode("1234567")] for f in FAMILIES}
    assert all(len(p) == 1 for p in runs["qwen3"]) and all(len(p) == 1 for p in runs["granite"])
    for f in ("llama3", "olmo2", "phi4", "phi4-mini"):
        assert "".join(runs[f]) == "1234567" and max(map(len, runs[f])) <= 3 and len(runs[f]) >= 3, runs[f]


def test_stop_tokens_and_bos(families) -> None:
    _, meta, ours = families["llama3"]
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    # llama.cpp: a llama-bpe vocabulary adds BOS unless the file says otherwise; <|eot_id|> ends a turn
    assert ours.encode("hi", add_special_tokens=True)[0] == vocab["<|begin_of_text|>"]
    assert vocab["<|eot_id|>"] in ours.eos_token_ids and ours.eos_token_id == vocab["<|end_of_text|>"]
    no_bos = build_gguf_tokenizer({**meta, "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("hi", add_special_tokens=True) == no_bos.encode("hi")
    _, qmeta, qwen = families["qwen3"]
    assert qmeta["tokenizer.ggml.tokens"].index("<|im_end|>") in qwen.eos_token_ids
    assert "<think>" not in [qwen.decode([i]) for i in qwen.encode("<think>")]  # control: skipped in text out


def test_unknown_or_missing_pre_is_refused(families) -> None:
    _, meta, _ = families["gpt2"]
    for value in ("default", "qwen35", "tekken", "", None):
        bad = {**meta, "tokenizer.ggml.pre": value} if value is not None else {
            k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"}
        with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre") as err:
            build_gguf_tokenizer(bad)
        assert repr(value) in str(err.value)
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.merges"):
        build_gguf_tokenizer({**meta, "tokenizer.ggml.merges": ["nospace"]})


def test_through_a_gguf_file(families, tmp_path) -> None:
    hf, meta, _ = families["qwen3"]
    ours = build_gguf_tokenizer(read_gguf_metadata(write_gguf(str(tmp_path / "q.gguf"), meta)))
    for text in TEXTS:
        assert ours.encode(text) == hf(text, add_special_tokens=False).input_ids
