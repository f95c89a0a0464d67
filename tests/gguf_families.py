"""A tiny Hugging Face model of ``model_families`` written as the GGUF file llama.cpp's converter
(convert_hf_to_gguf.py) would write for it (imported, not a conftest): the architecture's metadata
keys, llama.cpp's tensor names, the q/k row permutation of ``llama``/``granite``, Gemma's norms
stored with their ``+ 1``, Phi-3's longrope factors as tensors, no ``output.weight`` when tied, and
the byte-level BPE vocabulary of ``model_helpers.write_tokenizer_files`` as a ``gpt2`` tokenizer.
Weights F32, or Q8_0 for the 2-D block weights (``quant``)."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import torch
from gguf.quants import quantize as np_quantize

from model_families import make_family_model

# family -> (GGUF architecture, model_families overrides a GGUF can carry: llama.cpp stores no
# sliding window for `llama`/`qwen2`, derives Gemma's query scale from head_dim and Gemma 3's
# sliding pattern itself, and stores llama3 RoPE as a tensor recovered only for real checkpoints)
GGUF_CASES = {
    "llama": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "qwen2": ("qwen2", dict(use_sliding_window=False)),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
    "gemma3_text": ("gemma3", dict(query_pre_attn_scalar=16, num_hidden_layers=7,
                                   layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"])),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
}
_STEMS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm"}
_NORMS = {"llama": {"post_attention_layernorm": "ffn_norm"},
          "sandwich": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                       "post_feedforward_layernorm": "post_ffw_norm"},
          "olmo2": {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}}


def _gguf_name(name: str, arch: str) -> str:
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}[name]
    _, _, i, rest = name.split(".", 3)
    stem, kind = rest.rsplit(".", 1)
    norms = _NORMS["sandwich" if arch.startswith("gemma") else "olmo2" if arch == "olmo2" else "llama"]
    return f"blk.{i}.{norms.get(stem) or _STEMS[stem]}.{kind}"


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``permute`` of q/k rows (interleaved rotary pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(w: gguf.GGUFWriter, arch: str, cfg) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
        if cfg.attn_logit_softcapping is not None:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        orig = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(orig))) if scale > 1 else 1.0)
    if arch == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)


def _tokenizer(w: gguf.GGUFWriter, tokenizer_dir: str, vocab_size: int) -> None:
    """The converter's ``_set_vocab_gpt2``: the ids the tokenizer lacks up to the model's
    vocabulary size are ``[PAD{i}]`` tokens of type UNUSED."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [5 if i not in by_id else 3 if by_id[i].startswith("<") and by_id[i].endswith(">") else 1
             for i in range(vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])


def write_family_gguf(path: str, family: str, tokenizer_dir: str, quant: bool = False, seed: int = 0,
                      sampling: dict | None = None):
    """Write ``family``'s tiny model (``make_family_model`` with the case's overrides) to ``path``;
    returns the transformers model whose weights the file holds. ``sampling``: llama.cpp's
    ``general.sampling.*`` keys to add (``{"temp": 0.6}`` -> ``add_sampling_temp(0.6)``)."""
    arch, overrides = GGUF_CASES[family]
    model, cfg = make_family_model(family, seed, **overrides)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    w = gguf.GGUFWriter(path, arch)
    _metadata(w, arch, cfg)
    _tokenizer(w, tokenizer_dir, cfg.vocab_size)
    for key, value in (sampling or {}).items():
        getattr(w, f"add_sampling_{key}")(value)
    if arch == "phi3":
        rope = cfg.rope_parameters
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    for name, t in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if arch in ("llama", "granite") and (".q_proj." in name or ".k_proj." in name):
            t = _permute(t, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # Gemma's (1 + w), stored added
        data = t.numpy()
        if quant and data.ndim == 2 and name != "model.embed_tokens.weight" and data.shape[1] % 32 == 0:
            w.add_tensor(_gguf_name(name, arch), np_quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name, arch), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
