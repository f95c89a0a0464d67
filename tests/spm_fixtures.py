"""Tiny SentencePiece BPE models trained in the test, and the GGUF files llama.cpp's converter
writes for them (imported by the tokenizer tests, not a conftest).

``gguf_metadata_for`` follows ``convert_hf_to_gguf.py``'s ``_create_vocab_sentencepiece`` /
``_set_vocab_sentencepiece`` and ``gguf.SpecialVocab``: every piece with its score and type
(UNKNOWN / CONTROL / UNUSED / BYTE, else NORMAL), then the ``added_tokens_decoder`` entries of
tokenizer_config.json (special -> CONTROL, else USER_DEFINED with ``▁`` written back as a space),
score -1000; ``tokenizer.ggml.pre = "default"``; the special ids and ``add_bos/eos`` flags from
tokenizer_config.json; ``add_space_prefix`` false for Gemma.
"""

from __future__ import annotations

import random

WORDS = ("the quick brown fox jumps over lazy dog hello world naïve café 世界 你好 日本語 テキスト 한국어 "
         "emoji 🎉 👍🏽 🤖 def return if else for while 12 345 6789 I'm we're they'll it's user model "
         "assistant system answer question").split()


def training_corpus(seed: int = 0, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    ends = ["", "\n", "  ", "\t", "!", "?", " 2024", "\n\n"]
    return [" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice(ends) for _ in range(lines)]


def train_sentencepiece(prefix: str, *, add_dummy_prefix: bool, user_defined=(), control=(),
                        vocab_size: int = 600) -> str:
    """A SentencePiece BPE model with byte fallback (ids: <unk> 0, <s> 1, </s> 2); its path."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_corpus()), model_prefix=prefix, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        add_dummy_prefix=add_dummy_prefix, remove_extra_whitespaces=False, split_digits=False,
        allow_whitespace_only_pieces=True, user_defined_symbols=list(user_defined),
        control_symbols=list(control), bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return prefix + ".model"


def gguf_metadata_for(model_file: str, added_tokens: dict[int, tuple[str, bool]], *, arch: str,
                      add_bos: bool = True, add_eos: bool = False, eos_id: int = 2,
                      chat_template: str | None = None) -> dict:
    """The ``tokenizer.*`` keys llama.cpp's converter writes (``added_tokens``: id -> (content,
    special), as tokenizer_config.json's ``added_tokens_decoder``)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_file)
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 1)
    for i, (content, special) in added_tokens.items():
        types[i] = 3 if special else 4
        tokens[i] = content if special else content.replace("\u2581", " ")
        scores[i] = -1000.0
    meta = {"general.architecture": arch, "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": eos_id, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": add_bos, "tokenizer.ggml.add_eos_token": add_eos}
    if arch.startswith("gemma"):
        meta["tokenizer.ggml.add_space_prefix"] = False
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


def write_gguf(path: str, meta: dict) -> str:
    """A vocabulary-only GGUF file holding ``meta`` (what ``--vocab-only`` conversion writes)."""
    import gguf

    w = gguf.GGUFWriter(path, meta["general.architecture"])
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    for name in ("bos", "eos", "unk", "eot", "eom"):
        key = f"tokenizer.ggml.{'unknown' if name == 'unk' else name}_token_id"
        if key in meta:
            getattr(w, f"add_{name}_token_id")(meta[key])
    for name in ("bos", "eos"):
        if f"tokenizer.ggml.add_{name}_token" in meta:
            getattr(w, f"add_add_{name}_token")(meta[f"tokenizer.ggml.add_{name}_token"])
    if "tokenizer.ggml.add_space_prefix" in meta:
        w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    if "tokenizer.chat_template" in meta:
        w.add_chat_template(meta["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
