"""HF directories: ``config.json`` values checked with the key named, and held to the tensor
shapes read from the safetensors headers (no tensor loaded), before anything is built (issue 39
"Goals", issue 47 item 7: a ``vocab_size`` of 10**12 against 49,152 embedding rows).

Tiny random models of each family are saved by transformers itself, so the tensor layouts the
checks expect are transformers' own.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenbudget.engine.loader import check_model_files, load_model_files
from tokenbudget.engine.loader.hf_config import SUPPORTED_HF_ARCHS
from tokenbudget.engine.loader.hf_loader import safetensors_files
from tokenbudget.engine.loader.kv_shape import kv_elements_per_token
from tokenbudget.engine.loader.model_checks import check_hf_model

from model_families import FAMILIES, make_family_dir, make_gemma3_multimodal_dir


def save_tiny(path) -> None:
    """A tiny random Llama (hidden 64, 4 heads of 16, 2 KV heads, FFN 96, 2 layers, vocab 259)
    saved by transformers, with tokenizer files."""
    import transformers

    from model_helpers import write_tokenizer_files
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128, bos_token_id=256, eos_token_id=257)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    write_tokenizer_files(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(path)
    return path


@pytest.fixture
def model_dir(llama_dir, tmp_path, monkeypatch):
    """A copy of the tiny llama directory to spoil; loading a tensor in it fails the test (the
    checks must refuse the directory from the headers alone)."""
    from tokenbudget.engine.loader import hf_loader

    path = tmp_path / "model"
    shutil.copytree(llama_dir, path)

    def boom(*args, **kwargs):
        raise AssertionError("a tensor was loaded before the directory was checked")
    monkeypatch.setattr(hf_loader, "load_safetensors_dir", boom)
    return path


def edit_config(path, **changes) -> None:
    with open(path / "config.json") as f:
        cfg = json.load(f)
    for key, v in changes.items():
        if v is None:
            cfg.pop(key, None)
        else:
            cfg[key] = v
    (path / "config.json").write_text(json.dumps(cfg))


def refused(path, *fields: str) -> str:
    """Loading ``path`` (and checking, and sizing its KV) must each raise a ValueError that
    starts with the path and names each of ``fields``."""
    messages = set()
    for call in (load_model_files, check_model_files, kv_elements_per_token):
        with pytest.raises(ValueError) as exc:
            call(str(path))
        messages.add(str(exc.value))
    message = messages.pop()
    assert not messages, "the three calls disagree"
    assert type(exc.value) is ValueError and message.startswith(str(path)) and "\n" not in message, message
    for f in fields:
        assert f in message, message
    return message


@pytest.mark.parametrize("family", [*FAMILIES, "gemma3 image-text"])
def test_each_family_saved_by_transformers_passes_and_a_wrong_kv_head_count_fails(tmp_path, family):
    """Every supported family's tiny checkpoint (tests/model_families.py) passes the checks as
    transformers saved it; with ``num_key_value_heads`` 4 instead of 2 it fails on a projection."""
    if family == "gemma3 image-text":
        make_gemma3_multimodal_dir(tmp_path)
    else:
        make_family_dir(tmp_path, family)
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    files = safetensors_files(str(tmp_path))
    dims = check_hf_model(str(tmp_path), cfg, None, files)
    assert (dims.hidden.value, dims.heads.value, dims.kv_heads.value, dims.head_dim.value) == (64, 4, 2, 16)
    assert cfg["model_type"] in SUPPORTED_HF_ARCHS
    if "text_config" in cfg:
        cfg["text_config"]["num_key_value_heads"] = 4
    else:
        cfg["num_key_value_heads"] = 4
    with pytest.raises(ValueError, match="num_key_value_heads = 4") as exc:
        check_hf_model(str(tmp_path), cfg, None, files)
    assert re.search(r"model\.layers\.0\.self_attn\.(k|qkv)_proj\.weight has shape", str(exc.value)), str(exc.value)


@pytest.mark.parametrize("changes,fields", [
    (dict(vocab_size=10**12), ("vocab_size = 1000000000000 is out of range",)),
    (dict(vocab_size=49152), ("model.embed_tokens.weight has shape (259, 64)", "vocab_size = 49152")),
    (dict(hidden_size="64"), ("hidden_size must be an integer, got str '64'",)),
    (dict(hidden_size=64.0), ("hidden_size must be an integer, got float 64.0",)),
    (dict(hidden_size=True), ("hidden_size must be an integer, got bool",)),
    (dict(hidden_size=-64), ("hidden_size = -64 is out of range",)),
    (dict(hidden_size=2**40), ("hidden_size = 1099511627776 is out of range",)),
    (dict(hidden_size=None), ("hidden_size is missing",)),
    (dict(num_attention_heads=2), ("model.layers.0.self_attn.q_proj.weight has shape (64, 64)",
                                   "num_attention_heads = 2")),
    (dict(head_dim=None, num_attention_heads=8),
     ("model.layers.0.self_attn.k_proj.weight has shape (32, 64)", "hidden_size / num_attention_heads = 64 / 8 = 8")),
    (dict(head_dim=2**30), ("head_dim gives a head dimension of 1073741824",)),
    (dict(num_hidden_layers=1), ("num_hidden_layers = 1 but the file has tensors for layers 0 to 1",)),
    (dict(num_hidden_layers=3), ("num_hidden_layers = 3", "layer 2 is missing")),
    (dict(intermediate_size=95), ("model.layers.0.mlp.gate_proj.weight has shape (96, 64)", "intermediate_size = 95")),
    (dict(max_position_embeddings=2**31), ("max_position_embeddings = 2147483648 is out of range",)),
    (dict(eos_token_id=[257, 300]), ("eos_token_id = [257, 300] is not a token id below the vocabulary size 259",)),
    (dict(rms_norm_eps="tiny"), ("rms_norm_eps must be a finite positive number",)),
    (dict(tie_word_embeddings="no"), ("tie_word_embeddings must be true or false",)),
    (dict(model_type=["llama"]), ("model_type must be a string",)),
])
def test_config_values(model_dir, changes, fields):
    edit_config(model_dir, **changes)
    refused(model_dir, *fields)


def test_a_missing_or_misshapen_tensor(model_dir):
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, file)
    refused(model_dir, "the checkpoint is missing model.layers.1.self_attn.k_proj.weight")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(24, 64)
    save_file(tensors, file)
    refused(model_dir, "model.layers.1.self_attn.k_proj.weight has shape (24, 64)",
            "num_key_value_heads = 2", "head_dim = 16")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64, dtype=torch.int32)
    save_file(tensors, file)
    refused(model_dir, "'model.layers.1.self_attn.k_proj.weight' has dtype I32")


def test_corrupt_files(model_dir):
    file = model_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-1])
    refused(model_dir, f"{file}: not a readable safetensors file")
    file.write_bytes(data)
    (model_dir / "config.json").write_text("{not json")
    refused(model_dir, f"{model_dir / 'config.json'}: not a JSON file")
    (model_dir / "config.json").write_text("[1, 2]")
    refused(model_dir, "config.json must hold a JSON object")


def test_generation_config_and_index(model_dir, llama_dir):
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 10**9]}))
    refused(model_dir, "generation_config.json: eos_token_id = [257, 1000000000] is not a token id")
    (model_dir / "generation_config.json").unlink()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../model.safetensors"}}))
    refused(model_dir, "model.safetensors.index.json: weight_map must map tensor names to file names")
    os.remove(model_dir / "model.safetensors.index.json")
    shutil.copyfile(model_dir / "model.safetensors", model_dir / "copy.safetensors")
    refused(model_dir, "is also in another safetensors file")


def test_llm_raises_the_value_error(model_dir):
    from tokenbudget import LLM
    edit_config(model_dir, vocab_size=10**12)
    with pytest.raises(ValueError, match="vocab_size = 1000000000000"):
        LLM(model=str(model_dir), num_threads=1, kv_cache_memory_bytes=16 << 20)


def test_a_good_directory_still_loads(llama_dir):
    assert check_model_files(str(llama_dir)).vocab.value == 259
    assert kv_elements_per_token(str(llama_dir)) == 2 * 2 * 16
    loaded = load_model_files(str(llama_dir))
    assert loaded.config.vocab_size == 259 and "model.layers.1.mlp.down_proj.weight" in loaded.state_dict
