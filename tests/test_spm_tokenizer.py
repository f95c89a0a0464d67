"""SentencePiece vocabularies from GGUF (``tokenizer.ggml.model == "llama"``: Llama 2, Gemma 2/3,
Phi-3) against the tokenizers they were made from.

Tiny SentencePiece BPE models are trained here (byte fallback, a few hundred pieces), written as
the GGUF metadata llama.cpp's converter makes of them (``spm_fixtures``), read back through our GGUF
reader, and compared with two references on the same text: the ``sentencepiece`` library itself
(what the models were trained with) and transformers' tokenizer built by transformers from the
same GGUF file. Where the two references differ (``_transformers_differs``), ours follows
sentencepiece, as llama.cpp does.
"""

from __future__ import annotations

import json

import pytest
from chat_templates import GEMMA3  # noqa: E402
from hypothesis import given, settings
from hypothesis import strategies as st
from spm_fixtures import gguf_metadata_for, train_sentencepiece, write_gguf  # noqa: E402

from tokenbudget.engine.loader.gguf_loader import read_gguf_metadata
from tokenbudget.engine.text.gguf_tokenizer import build_gguf_tokenizer
from tokenbudget.engine.text.spm import SentencePieceBPE

from tokenizer_corpus import CORPUS, SAMPLES  # noqa: E402

spm = pytest.importorskip("sentencepiece", reason="needs sentencepiece (the [test] extra)")
transformers = pytest.importorskip("transformers", reason="needs transformers (the [test] extra)")

# unicode, emoji (with modifiers, ZWJ sequences, flags), whitespace runs of every kind, byte
# fallback (characters the 600-piece vocabulary lacks), digits, text that starts with spaces
EXTRA = ["  two leading", "\tTab first", "\n\nnewlines first", "trailing   ", "a  b   c    d     e",
         "👨‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 e\u0301 ﬁ Å ǅ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 \U0010fffd", "ዐማርኛ ภาษาไทย עִבְרִית العربية",
         "\u2581 already a meta space \u2581\u2581", "x" * 300 + " " + "the " * 50, "0123456789" * 7,
         "\r\n\r\n\x0b\x0c\x1c\x85\u2028\u2029", "mixed\u3000ideographic\u00a0nbsp\u200bzwsp"]
TEXTS = CORPUS + SAMPLES + EXTRA


def _starts_with_space(text: str) -> bool:
    """Where transformers' Metaspace skips the prefix (and decoding drops the first space)."""
    return text[:1].isspace() or text.startswith("\u2581")


def _transformers_differs(kind: str, text: str) -> bool:
    """Where transformers' GGUF tokenizers differ from sentencepiece (ours follows sentencepiece, as
    llama.cpp does): the ``llama`` builder's Metaspace adds no prefix to text that starts with a
    space; the ``gemma`` builder merges whitespace-run pieces as BPE pieces, where sentencepiece
    matches user-defined pieces longest first (5 spaces: 4 + 1, not 2 + 3)."""
    return (kind == "llama" and _starts_with_space(text)) or (kind == "gemma" and " " * 5 in text)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(kind -> (sentencepiece processor, our tokenizer, transformers' tokenizer)) for a Llama-style
    model (space prefix), a Phi-3 GGUF of the same model, and a Gemma-style one (no prefix, turn
    markers and whitespace runs as added tokens)."""
    root = tmp_path_factory.mktemp("spm")
    out = {}
    llama = train_sentencepiece(str(root / "llama"), add_dummy_prefix=True)
    gemma_user = ["<start_of_turn>", "<end_of_turn>", "\u2581\u2581", "\u2581\u2581\u2581", "\u2581\u2581\u2581\u2581"]
    gemma = train_sentencepiece(str(root / "gemma"), add_dummy_prefix=False, user_defined=gemma_user)
    for kind, model, arch in (("llama", llama, "llama"), ("phi3", llama, "phi3"), ("gemma", gemma, "gemma2")):
        sp = spm.SentencePieceProcessor(model_file=model)
        added = {}
        if kind == "gemma":  # Gemma's tokenizer_config: turn markers special, whitespace runs not
            added = {sp.piece_to_id(t): (t, t.startswith("<")) for t in gemma_user}
        path = write_gguf(str(root / f"{kind}.gguf"), gguf_metadata_for(model, added, arch=arch))
        ours = build_gguf_tokenizer(read_gguf_metadata(path))
        hf = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file=f"{kind}.gguf")
        out[kind] = (sp, ours, hf)
    return out


@pytest.mark.parametrize("kind", ["llama", "phi3", "gemma"])
def test_encode_equals_sentencepiece_and_transformers(models, kind: str) -> None:
    sp, ours, hf = models[kind]
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == sp.encode(text), text
        if not _transformers_differs(kind, text):
            assert ids == hf(text, add_special_tokens=False).input_ids, text
        assert ours.encode(text, add_special_tokens=True) == [1, *ids]  # add_bos_token, BOS id 1


@pytest.mark.parametrize("kind", ["llama", "phi3", "gemma"])
def test_decode_equals_transformers(models, kind: str) -> None:
    sp, ours, hf = models[kind]
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        if (kind == "gemma" or not _starts_with_space(text)) and "\u2581" not in text:  # ▁ reads back as a space
            assert ours.decode(ids) == sp.decode(ids) == text


def test_byte_fallback_and_unknown(models) -> None:
    sp, ours, _ = models["llama"]
    ids = ours.encode("€🦙ß")  # no piece for these: their UTF-8 bytes
    pieces = [ours.id_to_token(i) for i in ids]
    assert pieces[0] == "\u2581" and all(p.startswith("<0x") for p in pieces[1:]), pieces
    assert len(pieces) == 1 + len("€🦙ß".encode()) and ids == sp.encode("€🦙ß")
    # without byte tokens a missing character is the unknown token, consecutive ones fused (as sentencepiece)
    bpe = SentencePieceBPE(["<unk>", "a", "b", "ab"], [0.0, -1.0, -2.0, -0.5], [2, 1, 1, 1], unk_id=0)
    assert bpe.encode("ab☃☃a☃b") == [3, 0, 1, 0, 2]


def test_merges_follow_scores_leftmost_first() -> None:
    # pieces by score: "bc" beats "ab", so "abc" is a + bc even though "ab" comes first in the text
    bpe = SentencePieceBPE(["a", "b", "c", "ab", "bc"], [-9, -9, -9, -2.0, -1.0], [1] * 5, unk_id=None)
    assert bpe.encode("abc") == [0, 4]
    # equal scores: the leftmost pair merges first
    tie = SentencePieceBPE(["a", "b", "ab", "ba"], [-9, -9, -1.0, -1.0], [1] * 4, unk_id=None)
    assert tie.encode("aba") == [2, 0] and tie.encode("bab") == [3, 1]
    # an UNUSED piece is merged, then split back into the pieces it was made of
    unused = SentencePieceBPE(["a", "b", "ab", "abb"], [-9, -9, -1.0, -2.0], [1, 1, 5, 1], unk_id=None)
    assert unused.encode("ab") == [0, 1] and unused.encode("abb") == [3]


def _split_reference(sp, text: str, specials: dict[str, int], rstrip: set[str]) -> list[int]:
    """llama.cpp's ``tokenize`` for a SentencePiece vocabulary, written plainly: special tokens cut
    out leftmost-longest (``rstrip`` ones take the whitespace after them), the text between
    encoded by sentencepiece (whose dummy prefix is llama.cpp's space prefix of each fragment)."""
    out, i, start = [], 0, 0
    while i < len(text):
        hit = max((t for t in specials if text.startswith(t, i)), key=len, default=None)
        if hit is None:
            i += 1
            continue
        if start < i:
            out += sp.encode(text[start:i])
        out.append(specials[hit])
        i += len(hit)
        while hit in rstrip and i < len(text) and text[i].isspace():
            i += 1
        start = i
    return out + (sp.encode(text[start:]) if start < len(text) else [])


PHI3_CHAT = "<|user|>\nHi there<|end|>\n<|assistant|>\n  Hello! 😀<|end|>\n<|user|>\n\n2+2?<|end|>\n<|assistant|>\n"


def test_special_tokens_in_text(tmp_path) -> None:
    """Control/user-defined tokens spelled in the text are matched whole; the text after each gets
    the space prefix (llama.cpp; Phi-3's tokenizer.json Prepend normalizer); Phi-3's chat tokens
    take the whitespace after them (its tokenizer.json: ``rstrip``; llama.cpp does the same)."""
    names = ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
    model = train_sentencepiece(str(tmp_path / "phi"), add_dummy_prefix=True, control=names)
    sp = spm.SentencePieceProcessor(model_file=model)
    chat = {sp.piece_to_id(t): (t, True) for t in names}  # tokenizer_config.json: special
    meta = gguf_metadata_for(model, chat, arch="phi3", add_bos=False)
    path = write_gguf(str(tmp_path / "phi3.gguf"), meta)
    ours = build_gguf_tokenizer(read_gguf_metadata(path))
    specials = {t: i for i, (t, _) in chat.items()} | {"<s>": 1, "</s>": 2, "<unk>": 0}
    rstrip = set(specials) - {"<unk>", "<s>", "<|endoftext|>"}
    for text in [PHI3_CHAT, "<s>hello</s> <unk>x", "<|endoftext|> a", "<|end|>"]:
        assert ours.encode(text) == _split_reference(sp, text, specials, rstrip), text
    # transformers with Phi-3's tokenizer.json added-token flags gives the same ids
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="phi3.gguf")
    spec = json.loads(hf.backend_tokenizer.to_str())
    for tok in spec["added_tokens"]:
        tok["rstrip"] = tok["content"] in rstrip
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=type(hf.backend_tokenizer).from_str(json.dumps(spec)))
    assert ours.encode(PHI3_CHAT) == hf(PHI3_CHAT, add_special_tokens=False).input_ids
    # a non-Phi-3 architecture keeps the whitespace after special tokens
    plain = build_gguf_tokenizer({**read_gguf_metadata(path), "general.architecture": "llama"})
    assert plain.encode(PHI3_CHAT) == _split_reference(sp, PHI3_CHAT, specials, set())


def test_gemma_chat_markers_and_whitespace_tokens(models) -> None:
    sp, ours, hf = models["gemma"]
    text = "<start_of_turn>user\n  indented   code<end_of_turn>\n<start_of_turn>model\n"
    ids = ours.encode(text)
    assert ids == sp.encode(text) == hf(text, add_special_tokens=False).input_ids
    assert ours.decode(ids) == "user\n  indented   code\nmodel\n"  # markers are special: skipped
    assert ours.decode(ids, skip_special_tokens=False) == text
    # a chat prompt is encoded without adding BOS on top of the one the template writes
    prompt = ours.chat_prompt([{"role": "user", "content": "hi"}], chat_template=GEMMA3)
    assert prompt["prompt"].startswith("<s><start_of_turn>user\nhi")
    assert prompt["prompt_token_ids"] == ours.encode(prompt["prompt"]) and prompt["prompt_token_ids"].count(1) == 1


@settings(max_examples=150, deadline=None)
@given(st.text(st.sampled_from(list("abcdefghijklmnopqrstuvwxyz  \n\t.,'!?0123é世界你好🎉👍🏽\u2581"))
               | st.characters(exclude_categories=("Cs",)), max_size=40))
def test_encode_property_equals_sentencepiece(models, text: str) -> None:
    for kind in ("llama", "gemma"):
        sp, ours, _ = models[kind]
        assert ours.encode(text) == sp.encode(text)


def test_bad_metadata_names_the_key(models) -> None:
    _, ours, _ = models["llama"]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "\u2581a"]}
    assert build_gguf_tokenizer(meta).encode("a a") == [3, 3]  # scores and types default
    for key, value in [("tokenizer.ggml.scores", [0.0]), ("tokenizer.ggml.token_type", "1111"),
                       ("tokenizer.ggml.eos_token_id", 99), ("tokenizer.ggml.tokens", ["a", 1])]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            build_gguf_tokenizer({**meta, key: value})
    with pytest.raises(ValueError, match="add_bos_token"):
        build_gguf_tokenizer({**meta, "tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.tokens": ["a"]})
