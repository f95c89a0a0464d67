"""Tokenizer: HF directory, GGUF byte-level BPE (SmolLM2), GGUF SentencePiece, chat templates."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from tokenbudget.engine.text.gguf_tokenizer import build_gguf_tokenizer
from tokenbudget.engine.text.tokenizer import Tokenizer

from model_helpers import hf_gguf_tokenizer, smollm2_gguf_tokenizer  # noqa: E402
from tokenizer_corpus import CORPUS, SAMPLES

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _trained_backend() -> HFTok:
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SAMPLES * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tok")
    _trained_backend().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "<|im_end|>", "chat_template": CHATML}))
    return path


def test_hf_dir_basics(hf_dir) -> None:
    tok = Tokenizer.from_pretrained_dir(hf_dir)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 3 and tok.eos_token_ids == [3]
    assert 300 < tok.vocab_size <= 400 and set(tok.all_special_ids) == {0, 1, 2, 3}
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s
    assert tok.id_to_token(2) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 3
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == 2 and ids.count(3) == 1
    assert tok.decode(ids) == "user\nhi\nassistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == text
    no_gen = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert no_gen == "<|im_start|>user\nhi<|im_end|>\n"


def test_hf_dir_template_sources(hf_dir, tmp_path) -> None:
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "chat_template": [{"name": "tool_use", "template": "T"},
                                              {"name": "default", "template": "D{{ eos_token }}"}]}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.bos_token_id is None and tok.apply_chat_template([]) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages|length == 0 %}{{ raise_exception('need messages') }}{% endif %}"
        "{{ messages[0]['content']|tojson }}{{ extra }}")
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}], extra="!") == '"é"!'
    with pytest.raises(ValueError, match="need messages"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template("hi")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained_dir(tmp_path / "nowhere")


# ---------------------------------------------------------------- SmolLM2 GGUF


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return smollm2_gguf_tokenizer()


def test_smollm2_roundtrip_and_specials(smol: Tokenizer) -> None:
    for s in SAMPLES:
        assert smol.decode(smol.encode(s)) == s
    assert smol.vocab_size == 49152
    assert (smol.bos_token_id, smol.eos_token_id) == (1, 2)
    assert smol.all_special_ids == list(range(17))
    assert smol.encode("<|im_start|>user") == [1, 4093]
    # SmolLM2's pre-tokenizer splits every digit (HF: Digits(individual_digits=True)).
    assert [smol.id_to_token(i) for i in smol.encode("x 2024")] == ["x", "Ġ", "2", "0", "2", "4"]
    assert smol.encode("Hello world", add_special_tokens=True) == smol.encode("Hello world")  # no BOS


def test_smollm2_chat_template(smol: Tokenizer) -> None:
    text = smol.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    ids = smol.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 2 and ids[-1] == 198  # "\n"
    assert smol.decode(ids, skip_special_tokens=False) == text


# Unicode (accents, CJK, Hangul, emoji with a skin-tone modifier, math), whitespace runs (spaces,
# tabs, newlines, NBSP, zero-width), digit runs and numbers, contractions, code, special tokens
# spelled inside text, and the empty string.
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there\n\n"},
          {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "Count: 1 2 3"}]]


@pytest.fixture(scope="module")
def hf_smol():
    return hf_gguf_tokenizer()


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_encodes_and_decodes_like_transformers(smol: Tokenizer, hf_smol, text: str) -> None:
    """Ours vs transformers' tokenizer built from the same GGUF metadata: same ids, same text back."""
    ids = hf_smol(text).input_ids
    assert smol.encode(text, add_special_tokens=True) == ids
    for skip in (False, True):
        assert smol.decode(ids, skip_special_tokens=skip) == hf_smol.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", CHATS)
def test_smollm2_chat_template_like_transformers(smol: Tokenizer, hf_smol, messages) -> None:
    text = smol.apply_chat_template(messages)
    assert text == hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smol.encode(text, add_special_tokens=True) == hf_smol(text).input_ids


def test_smollm2_vocabulary_and_specials_like_transformers(smol: Tokenizer, hf_smol) -> None:
    assert smol.vocab_size == len(hf_smol)
    assert (smol.bos_token_id, smol.eos_token_id) == (hf_smol.bos_token_id, hf_smol.eos_token_id)
    # every token the GGUF marks special (HF's added tokens flagged special), not only bos/eos/unk
    assert smol.all_special_ids == sorted(i for i, t in hf_smol.added_tokens_decoder.items() if t.special)


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",)), max_size=60))
def test_smollm2_encode_property_like_transformers(smol: Tokenizer, hf_smol, s: str) -> None:
    assert smol.encode(s, add_special_tokens=True) == hf_smol(s).input_ids


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",)), max_size=40))
def test_smollm2_roundtrip_property(smol: Tokenizer, smol_bytes: set[int], s: str) -> None:
    # SmolLM2's byte-level vocabulary (as its HF tokenizer.json) lacks a few bytes (most ASCII
    # control characters, UTF-8 lead bytes F1..F7 for code points >= U+40000); BPE without an
    # unk token drops them, so the round trip holds for text made of the other bytes.
    assume(all(b in smol_bytes for b in s.encode()))
    assert smol.decode(smol.encode(s)) == s


@pytest.fixture(scope="module")
def smol_bytes(smol: Tokenizer) -> set[int]:
    vocab = smol.backend.get_vocab()
    return {b for b, c in _byte_chars().items() if c in vocab}


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# ---------------------------------------------------------------- GGUF SentencePiece ("llama")


def _sp_metadata() -> dict:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = ["ll", "\u2581h", "\u2581he", "llo", "\u2581hello", "\u2581w", "or", "\u2581wor", "ld",
             "\u2581world", "\u2581", "h", "e", "l", "o", "w", "r", "d"]  # merged pieces by rank
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces + words,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types + [1] * len(words),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True}


def test_gguf_sentencepiece_tokenizer() -> None:
    tok = build_gguf_tokenizer(_sp_metadata())
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["\u2581hello", "\u2581world"]
    assert tok.encode("hello", add_special_tokens=True)[0] == 1
    assert tok.decode(ids) == "hello world"
    enc = tok.encode("hé")  # é is not in the vocabulary: byte fallback
    assert [tok.id_to_token(i) for i in enc][-2:] == ["<0xC3>", "<0xA9>"]
    assert tok.decode(enc) == "hé"


def test_gguf_unsupported_tokenizer_model() -> None:
    with pytest.raises(NotImplementedError, match="bert"):
        build_gguf_tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="tokens"):
        build_gguf_tokenizer({"tokenizer.ggml.model": "gpt2"})
