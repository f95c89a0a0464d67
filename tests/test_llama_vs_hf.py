"""Our Llama-family forward vs transformers on tiny random models (fp32, CPU).

Covers Llama (MHA and GQA, llama3 and linear rope scaling), Mistral, Qwen2 (q/k/v bias) and a
tied-embedding model, through the paged KV cache with random NON-contiguous block tables and
prefills fed in chunks of random sizes, several requests per batch.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch
import transformers

from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.scheduler.output import SchedulerOutput
from tokenbudget.scheduler.request import Request

from model_helpers import scheduled
from paged_forward import chunked_logits, make_runner, random_tables

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=10000.0)

CASES = {
    "llama_gqa": ("llama", dict()),
    "llama_mha_tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3_rope": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64})),
    "linear_rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "yarn_rope": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 128})),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=1)),
}


def make_hf(arch: str, extra: dict, seed: int = 0):
    torch.manual_seed(seed)
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    kw = {**BASE, **extra}
    rope_scaling = kw.pop("rope_scaling", None)
    hf_cfg = cls_cfg(**kw, attn_implementation="eager")
    if rope_scaling is not None:
        hf_cfg.rope_parameters = {"rope_theta": kw["rope_theta"], **rope_scaling}
    hf = cls_model(hf_cfg).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise them
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    cfg = ModelConfig(
        architecture=arch, vocab_size=kw["vocab_size"], hidden_size=kw["hidden_size"],
        intermediate_size=kw["intermediate_size"], num_hidden_layers=kw["num_hidden_layers"],
        num_attention_heads=kw["num_attention_heads"], num_key_value_heads=kw["num_key_value_heads"],
        rms_norm_eps=kw["rms_norm_eps"], rope_theta=kw["rope_theta"], rope_scaling=rope_scaling,
        max_position_embeddings=kw["max_position_embeddings"],
        tie_word_embeddings=kw.get("tie_word_embeddings", False), attention_bias=arch == "qwen2")
    return hf, cfg


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_paged_forward_matches_hf(case):
    arch, extra = CASES[case]
    hf, cfg = make_hf(arch, extra)
    model = build_model(cfg, hf.state_dict(), torch.float32, "cpu")
    rng = random.Random(zlib.crc32(case.encode()))  # stable across processes (str hash is salted)
    lens = [rng.randint(1, 40) for _ in range(3)] + [150]  # 150: > 1 key tile at the end
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lens]
    block_size = 4
    runner = make_runner(model, cfg, num_blocks=128, block_size=block_size)
    tables = random_tables(rng, lens, 128, block_size)
    ours = chunked_logits(runner, prompts, tables, rng)
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        torch.testing.assert_close(o, ref, atol=2e-5, rtol=1e-5)


def test_long_context_over_key_tiles():
    """A context past 256 keys (several P @ V tiles) still matches HF."""
    hf, cfg = make_hf("llama", {})
    model = build_model(cfg, hf.state_dict(), torch.float32, "cpu")
    rng = random.Random(7)
    p = [rng.randrange(cfg.vocab_size) for _ in range(300)]
    runner = make_runner(model, cfg, num_blocks=80, block_size=4)
    tables = random_tables(rng, [300], 80, 4)
    sched = SchedulerOutput([scheduled(Request("a", p), 0, 300, p, [], tables[0])])
    ids, pos, md, _ = runner.prepare_inputs(sched)
    ours = model.compute_logits(model(ids, pos, md, runner.kv_caches))
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)


def test_bad_rope_and_weights_rejected():
    hf, cfg = make_hf("llama", {})
    sd = hf.state_dict()
    import msgspec
    bad = msgspec.structs.replace(cfg, rope_scaling={"rope_type": "made_up", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type"):
        build_model(bad, sd)
    with pytest.raises(ValueError, match="low_freq_factor"):
        build_model(msgspec.structs.replace(cfg, rope_scaling={"rope_type": "llama3", "factor": 8.0}), sd)
    with pytest.raises(ValueError, match="unexpected tensor model.layers.0.pre_feedforward_layernorm"):
        build_model(cfg, {**sd, "model.layers.0.pre_feedforward_layernorm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight has shape"):
        build_model(cfg, {**sd, "model.layers.1.mlp.down_proj.weight": torch.ones(64, 95)})
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="up_proj"):
        build_model(cfg, sd)
