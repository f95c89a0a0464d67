"""Small model/tokenizer builders shared by several test files (imported, not a conftest)."""

from __future__ import annotations

import functools
import json
import os


def write_tokenizer_files(path) -> None:
    """A byte-level BPE tokenizer.json (no merges) + tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"},
                   "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"}, f)


def hf_llama_from_loaded(loaded):
    """transformers' LlamaForCausalLM carrying a LoadedModel's weights (tied embeddings)."""
    import transformers

    c = loaded.config
    hf = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.resolved_head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(hf).eval()
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model


def smollm2_gguf_tokenizer():
    """The default model's tokenizer read from its GGUF metadata (skips only where the file
    cannot be had: ``engine_fixtures.default_model_path_or_skip``)."""
    from tokenbudget.engine.loader.gguf_loader import read_gguf_metadata
    from tokenbudget.engine.text.gguf_tokenizer import build_gguf_tokenizer

    from engine_fixtures import default_model_path_or_skip
    return build_gguf_tokenizer(read_gguf_metadata(default_model_path_or_skip()))


@functools.cache
def hf_gguf_tokenizer():
    """transformers' tokenizer for the default model, built by transformers itself from the same
    GGUF's metadata (``gguf_file=``, via the ``gguf`` package): the reference our tokenizer is
    compared with, and what the vs-transformers tests feed transformers (its own ids, not ours)."""
    import transformers

    from engine_fixtures import default_model_path_or_skip
    path = default_model_path_or_skip()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def scheduled(req, nc: int, n: int, token_ids, spec, table, needs_sample: bool | None = None):
    """The ``ScheduledRequest`` the scheduler would build for ``req`` running positions
    ``[nc, nc + n)`` (the last ``len(spec)`` of them drafts) over block table ``table``."""
    from tokenbudget.scheduler.output import ScheduledRequest
    if needs_sample is None:
        needs_sample = nc + n >= req.num_tokens
    num_output = req.num_tokens - len(req.prompt_token_ids)
    return ScheduledRequest(request_id=req.request_id, num_computed_tokens=nc, token_ids=list(token_ids),
                            spec_token_ids=list(spec), block_ids=list(table), is_new=nc == 0,
                            needs_sample=needs_sample, params=req.sampling_params, seed=req.seed,
                            num_output_tokens=num_output, banned_token_ids=req.min_tokens_banned,
                            spec_probs=req.spec_probs[:len(spec)] if req.spec_probs is not None and spec else None)
