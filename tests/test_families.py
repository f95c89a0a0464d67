"""Every supported family against transformers, on tiny random models (fp32, CPU, torch path).

For each family of ``model_families.FAMILIES`` (Llama 3.x, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3,
Phi-3, OLMo 2, Granite), built by transformers and saved as a Hugging Face directory:

* the forward through the paged KV cache (random non-contiguous block tables, prefills fed in
  random chunks, three requests per step) gives transformers' logits within 1e-4 relative, with
  prompts longer than the 8-key sliding windows;
* ``LLM(model=dir)`` decodes 3 prompts x 32 tokens greedily exactly as transformers does;
* n-gram speculation and a draft model give exactly the plain decoding's tokens, with prefill
  chunks of 16 tokens and a KV pool small enough to preempt.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.entrypoints.llm import LLM
from tokenbudget.engine.loader import load_model_files
from tokenbudget.engine.model import build_model

from model_families import FAMILIES, greedy_reference, make_family_dir
from paged_forward import chunked_logits, make_runner, random_tables

PROMPTS = [[(7 * i) % 250 for i in range(40)],  # long enough for the sliding windows
           [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4],
           [42] * 6 + list(range(100, 120)) + [42] * 6 + list(range(100, 110))]  # repeats: n-gram hits
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """``(name, HF directory, transformers model)`` of one family's tiny model."""
    path = make_family_dir(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return request.param, path, hf


def test_forward_matches_transformers(family) -> None:
    name, path, hf = family
    loaded = load_model_files(path, torch.float32)
    assert loaded.config.architecture == FAMILIES[name][0]
    model = build_model(loaded.config, loaded.state_dict)
    runner = make_runner(model, loaded.config, num_blocks=80, block_size=4)
    rng = random.Random(0)
    tables = random_tables(rng, [len(p) for p in PROMPTS], 80, 4)
    for prompt, ours in zip(PROMPTS, chunked_logits(runner, PROMPTS, tables, rng)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt]), use_cache=False).logits[0]
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4, name


@pytest.fixture(scope="module")
def reference(family):
    name, path, hf = family
    return [greedy_reference(hf, p, MAX_TOKENS)[0] for p in PROMPTS]


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_matches_transformers(family, reference) -> None:
    name, path, _ = family
    llm = LLM(path, dtype="float32", num_threads=1, kv_cache_memory_bytes=4 << 20)
    assert _generate(llm) == reference, name


def _small_pool(path: str, blocks: int, block_size: int, drafter_layers: int = 0) -> int:
    """KV bytes for ``blocks`` blocks of the target plus a drafter of ``drafter_layers`` layers."""
    from tokenbudget.engine.loader.kv_shape import kv_elements_per_token
    per_token = kv_elements_per_token(path)
    import json
    import os
    with open(os.path.join(path, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    return int(blocks * block_size * 2 * 4 * per_token * (1 + drafter_layers / layers)) + 1


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_is_lossless_chunked_and_preempted(family, reference, method, tmp_path) -> None:
    """16-token steps (prefills chunked, verifies squeezed) and 12 blocks of 8 for ~250 tokens in
    flight (preemption); the drafter is another random model of the same family (1 layer)."""
    name, path, _ = family
    if method == "ngram":
        spec, drafter_layers = {"method": "ngram", "num_speculative_tokens": 4}, 0
    else:
        draft = make_family_dir(tmp_path / "draft", name, seed=1, num_hidden_layers=1)
        spec, drafter_layers = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}, 1
    llm = LLM(path, dtype="float32", num_threads=1, speculative_config=spec, block_size=8,
              max_num_batched_tokens=16, kv_cache_memory_bytes=_small_pool(path, 12, 8, drafter_layers))
    assert _generate(llm) == reference, name
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    assert llm.get_spec_stats().num_draft_tokens > 0
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_gemma3_image_text_checkpoint_runs_its_language_model(tmp_path) -> None:
    """A Gemma 3 4B-27B style checkpoint (model_type gemma3, a vision tower beside the language
    model): its text model loads alone (the tower's tensors unread) and decodes as transformers."""
    from model_families import make_gemma3_multimodal_dir

    path, hf = make_gemma3_multimodal_dir(tmp_path / "mm")
    loaded = load_model_files(path)
    assert loaded.config.architecture == "gemma3_text"
    assert not any("vision" in k or "projector" in k for k in loaded.state_dict)
    llm = LLM(path, dtype="float32", num_threads=1, kv_cache_memory_bytes=4 << 20)
    assert _generate(llm)[:2] == [greedy_reference(hf, p, MAX_TOKENS)[0] for p in PROMPTS[:2]]


def test_mxfp4_experts_dequantize_as_transformers_does(tmp_path) -> None:
    """gpt-oss's published checkpoints keep their experts in MXFP4 (``*_blocks`` / ``*_scales``):
    they load as transformers dequantizes them, and the model decodes as transformers does on the
    dequantized weights."""
    path = make_family_dir(tmp_path / "gpt_oss", "gpt_oss")
    import safetensors.torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tokenbudget.engine.loader.mxfp4 import dequantize_mxfp4
    gen = torch.Generator().manual_seed(0)
    sd = safetensors.torch.load_file(f"{path}/model.safetensors")
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, inp, out = sd[key].shape
        blocks = torch.randint(0, 256, (e, out, inp // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(120, 128, (e, out, inp // 32), dtype=torch.uint8, generator=gen)
        want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(dequantize_mxfp4(blocks, scales), want)
        del sd[key]
        sd[key + "_blocks"], sd[key + "_scales"] = blocks, scales
        sd[key + "_reference"] = want
    packed = tmp_path / "mxfp4"
    import shutil
    shutil.copytree(path, packed)
    safetensors.torch.save_file({k: v for k, v in sd.items() if not k.endswith("_reference")},
                                f"{packed}/model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        for key in [k for k in sd if k.endswith("_reference")]:
            hf.get_parameter(key[:-len("_reference")]).copy_(sd[key])
    llm = LLM(str(packed), dtype="float32", num_threads=1, kv_cache_memory_bytes=4 << 20)
    assert _generate(llm)[:1] == [greedy_reference(hf, PROMPTS[0], MAX_TOKENS)[0]]


def test_parameter_counts_match_transformers(family) -> None:
    """The start-up line's parameter count is the checkpoint's (an MoE's active count: its top k)."""
    name, path, hf = family
    loaded = load_model_files(path, torch.float32)
    total, active = build_model(loaded.config, loaded.state_dict).num_parameters
    assert total == sum(p.numel() for p in hf.parameters()), name
    assert (active < total) == bool(loaded.config.num_experts), name
