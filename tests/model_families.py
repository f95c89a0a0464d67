"""Tiny random models of every supported family, built by transformers (imported, not a conftest).

Each case is a transformers config with the family's switches turned on at sizes that make them
matter on short prompts: sliding windows of 8 keys, soft-caps that bend the scores, partial rotary,
longrope, per-layer RoPE, multipliers, biases, (1 + w) and post norms, q/k norms. Norms and biases
are randomised (transformers initialises them to 1 / 0, which would hide a wrong offset or a
missing bias). ``make_family_dir`` saves one as a Hugging Face directory with a byte-level BPE
tokenizer (``model_helpers.write_tokenizer_files``), the form ``LLM(model=dir)`` loads.
"""

from __future__ import annotations

import os

import torch
import transformers

from model_helpers import write_tokenizer_files

VOCAB = 300  # > the 259 ids of write_tokenizer_files' tokenizer
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256, eos_token_id=257,
            pad_token_id=None, initializer_range=0.08)

FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64})),
    "mistral": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=16, attention_bias=True)),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=1.5, final_logit_softcapping=2.0)),
    "gemma3_text": ("gemma3_text", dict(head_dim=16, sliding_window=8, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1_000_000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5, original_max_position_embeddings=128,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0, 1.3, 2.0, 3.0],
                                           "long_factor": [1.0, 4.0, 8.0, 16.0],
                                           "original_max_position_embeddings": 128, "partial_rotary_factor": 0.5})),
    "olmo2": ("olmo2", dict()),
    "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True,
                                sliding_window=8)),
    "ministral": ("ministral", dict(head_dim=16, sliding_window=8, num_hidden_layers=3,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=64, decoder_sparse_step=1,
                                    mlp_only_layers=[1], num_hidden_layers=3)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16,
                                    norm_topk_prob=True)),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False})),
    "granite": ("granite", dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.2,
                                logits_scaling=3.0, attention_bias=True, mlp_bias=True)),
}


def make_family_model(family: str, seed: int = 0, **overrides):
    """``(transformers model in eval mode, its config)`` for ``family`` (a key of FAMILIES);
    ``overrides``: config values (``num_hidden_layers`` also sizes ``layer_types``)."""
    model_type, extra = FAMILIES[family]
    kw = {**BASE, **extra, **overrides}
    if "layer_types" in kw:  # the family's pattern, repeated or cut to the layer count
        kw["layer_types"] = [kw["layer_types"][i % len(kw["layer_types"])] for i in range(kw["num_hidden_layers"])]
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if model_type.startswith("gemma") else 1.0))
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    return model, cfg


def make_family_dir(path, family: str, seed: int = 0, **overrides) -> str:
    """``family``'s tiny model saved as a Hugging Face directory with a tokenizer; returns the path."""
    model, _ = make_family_model(family, seed, **overrides)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path))
    write_tokenizer_files(str(path))
    return str(path)


def greedy_reference(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ``prompt`` without a KV cache (a full forward per
    token: the reference), and the logits of every generated position ``[max_tokens, V]``."""
    ids, rows = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            rows.append(logits)
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], torch.stack(rows)


def make_gemma3_multimodal_dir(path, seed: int = 0) -> tuple[str, torch.nn.Module]:
    """A tiny Gemma 3 image-text checkpoint (``model_type`` gemma3: a SigLIP tower, a projector and
    the gemma3_text case's language model), saved with a tokenizer; ``(path, transformers model)``."""
    _, text = make_family_model("gemma3_text", seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path))
    write_tokenizer_files(str(path))
    return str(path), model
