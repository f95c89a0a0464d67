"""A tiny random Llama HF directory with a byte-level vocabulary (259 ids: 256 bytes + 3
specials), for tests that need a real model and tokenizer but not the default model's weights
(server tests that check behaviour, not text). Imported, not a conftest."""

from __future__ import annotations

import os

import pytest
import torch

from model_helpers import write_tokenizer_files


def make_tiny_llama_dir(path, *, layers: int = 1, hidden: int = 32, vocab: int = 259, seed: int = 0) -> str:
    """Write a random ``LlamaForCausalLM`` (``save_pretrained``) and its tokenizer to ``path``."""
    transformers = pytest.importorskip("transformers")
    os.makedirs(path, exist_ok=True)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, initializer_range=0.5,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    write_tokenizer_files(str(path))
    return str(path)
