"""A tiny random target and random EAGLE-3 heads for it (published layout, written with
``save_eagle3``), and a from-scratch reference of what the head must draft: the target's hidden
states from Hugging Face's ``output_hidden_states`` over the whole sequence and the head run with
plain causal attention, no cache, no engine."""

from __future__ import annotations

import json
import os

import torch
import transformers

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.entrypoints.llm import LLM
from tokenbudget.engine.model.eagle3 import Eagle3Config, Eagle3Head, causal_attention, save_eagle3

from tiny_llama import VOCAB, make_tiny_llama

TARGET_LAYERS = 6
HIDDEN = 64
AUX_IDS = (1, 3, 4)
DRAFT_VOCAB = 200


def head_config(**overrides) -> Eagle3Config:
    cfg = dict(hidden_size=HIDDEN, target_hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=2 * HIDDEN, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
               aux_layer_ids=AUX_IDS)
    cfg.update(overrides)
    return Eagle3Config(**cfg)


def random_head(seed: int = 0, scale: float = 0.2, **overrides) -> Eagle3Head:
    """Weights ~ N(0, scale): peaky enough that argmax ties never happen."""
    cfg = head_config(**overrides)
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or name == "norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    head.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=gen)[:cfg.draft_vocab_size])
    return head.eval()


def make_target(path) -> str:
    return make_tiny_llama(path, layers=TARGET_LAYERS, hidden=HIDDEN, seed=0, scale=8.0)


def write_head(path, head: Eagle3Head) -> str:
    save_eagle3(head, str(path), dtype=torch.float32)
    return str(path)


@torch.no_grad()
def reference_drafts(hf: transformers.LlamaForCausalLM, head: Eagle3Head, tokens: list[int],
                     k: int) -> tuple[list[int], torch.Tensor]:
    """Greedy drafts 1..k after committed ``tokens`` and the draft logits of draft 1."""
    n = len(tokens) - 1  # head rows at positions 0 .. L - 2
    out = hf(torch.tensor([tokens[:n]]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in head.config.aux_layer_ids], dim=-1)
    embed = hf.model.embed_tokens
    embeds = embed(torch.tensor(tokens[1:]))
    hidden = head.fuse(aux)
    positions = torch.arange(n)
    drafts, first = [], None
    for j in range(k):
        h, logits = head(embeds, hidden, positions, causal_attention)
        if first is None:
            first = logits[-1].clone()
        d = int(head.to_target_ids(logits[-1].argmax()).item())
        drafts.append(d)
        embeds = torch.cat([embeds, embed(torch.tensor([d]))])
        hidden = torch.cat([hidden, h[-1:]])
        positions = torch.arange(n + j + 1)
    return drafts, first


# ---- the engine over the tiny target, shared by the EAGLE-3 test modules ----

PROMPTS = ["hello world, hello world, hello", "abcabcabcabc", "The quick brown fox",
           "x" * 40 + " then some more text to make this prompt a good deal longer than the others"]


def engine(target, spec=None, **opts) -> LLM:
    opts.setdefault("kv_cache_memory_bytes", 4 << 20)
    opts.setdefault("num_threads", 1)
    return LLM(str(target), speculative_config=spec, **opts)


def eagle(head_dir, k=3) -> dict:
    return {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": k}


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def kv_bytes(target, blocks: int, block_size: int = 8) -> int:
    with open(os.path.join(target, "config.json")) as f:
        c = json.load(f)
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return blocks * c["num_hidden_layers"] * 2 * block_size * c["num_key_value_heads"] * head_dim * 4


def make_dirs(root) -> dict:
    """The tiny target and a random head under ``root`` (a module fixture's temporary folder)."""
    return {"root": root, "target": make_target(root / "target"), "head": write_head(root / "head", random_head(0))}


def baseline_tokens(dirs) -> list[list[int]]:
    """Plain decoding's greedy tokens for ``PROMPTS`` on the tiny target."""
    return token_ids(engine(dirs["target"]), PROMPTS, greedy())
