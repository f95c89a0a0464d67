"""Random tiny Llama checkpoints as Hugging Face directories (imported, not a conftest): a target
and drafters related to it, for the draft-model and speculation tests."""

from __future__ import annotations

import os

import torch
import transformers

from model_helpers import write_tokenizer_files

VOCAB = 259
def make_tiny_llama(path, *, layers: int, hidden: int = 64, vocab: int = VOCAB, seed: int = 0,
                    scale: float = 1.0) -> str:
    """A random Llama HF directory; ``scale`` multiplies the init std (larger: peakier logits,
    so a related drafter agrees more often)."""
    os.makedirs(path, exist_ok=True)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.02 * scale, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(path))
    write_tokenizer_files(str(path))
    return str(path)


def make_truncated_copy(src, path, layers: int) -> str:
    """A separate HF directory holding the first ``layers`` layers of ``src`` (a related drafter)."""
    model = transformers.LlamaForCausalLM.from_pretrained(str(src))
    cfg = model.config
    cfg.num_hidden_layers = layers
    small = transformers.LlamaForCausalLM(cfg)
    missing, _ = small.load_state_dict(model.state_dict(), strict=False)
    assert not missing
    small.save_pretrained(str(path))
    write_tokenizer_files(str(path))
    return str(path)
