"""Every family's GGUF form (written as llama.cpp's converter writes it: ``gguf_families``) against
its Hugging Face form: the same weights after loading (Gemma's stored ``+ 1``, the q/k row
permutation, Phi-3's longrope factors undone), the same logits, the same greedy tokens through
``LLM``; a Q8_0 file within Q8_0's rounding of the float model."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.entrypoints.llm import LLM
from tokenbudget.engine.loader import load_model_files
from tokenbudget.engine.model import build_model

from gguf_families import GGUF_CASES, write_family_gguf
from model_helpers import write_tokenizer_files
from paged_forward import chunked_logits, make_runner, random_tables

PROMPTS = [[(7 * i) % 250 for i in range(40)], [42] * 6 + list(range(100, 120)) + [42] * 6]


@pytest.fixture(scope="module", params=list(GGUF_CASES))
def forms(request, tmp_path_factory):
    """``(family, HF directory, F32 GGUF, Q8_0 GGUF)`` holding the same weights."""
    root = tmp_path_factory.mktemp(request.param)
    write_tokenizer_files(str(root))
    f32 = write_family_gguf(str(root / "m.f32.gguf"), request.param, str(root))
    write_family_gguf(str(root / "m.q8_0.gguf"), request.param, str(root), quant=True)
    f32.save_pretrained(str(root / "hf"))
    write_tokenizer_files(str(root / "hf"))
    return request.param, str(root / "hf"), str(root / "m.f32.gguf"), str(root / "m.q8_0.gguf")


def _logits(path: str) -> list[torch.Tensor]:
    import random
    loaded = load_model_files(path, torch.float32)
    model = build_model(loaded.config, loaded.state_dict)
    runner = make_runner(model, loaded.config, num_blocks=40, block_size=4)
    rng = random.Random(0)
    return chunked_logits(runner, PROMPTS, random_tables(rng, [len(p) for p in PROMPTS], 40, 4), rng)


def test_gguf_loads_the_hf_model(forms) -> None:
    family, hf, f32, _ = forms
    for got, want in zip(_logits(f32), _logits(hf)):
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6, family


def test_gguf_and_hf_forms_decode_the_same(forms) -> None:
    family, hf, f32, _ = forms
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(path):
        llm = LLM(path, dtype="float32", quantization="none", num_threads=1, kv_cache_memory_bytes=4 << 20)
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert run(f32) == run(hf), family


def test_q8_0_is_the_float_model_within_its_rounding(forms) -> None:
    """Q8_0 rounds each weight to d * q with d = amax/127 per 32 values: a relative error of at most
    1/254 per weight. Through a 2-layer model that stays near it: the logits within 5 % of their
    scale, where a wrong tensor or layout is off by their whole scale."""
    family, hf, _, q8 = forms
    for got, want in zip(_logits(q8), _logits(hf)):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert 0 < err < 0.05, (family, err)
