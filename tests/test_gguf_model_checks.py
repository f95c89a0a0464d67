"""GGUF metadata held to the tensors' shapes before anything is dequantized, and its values
bounded (issue 39 "Goals", issue 47 items 6/7): a ValueError naming the key and both numbers.

Tiny models of each family are crafted in llama.cpp's layout (tests/gguf_craft.py); the issue's
own cases (``head_count`` 3 where the tensors say 9, ``block_count`` 5 in a 30-layer file) are
byte patches of the default model, loaded through ``LLM`` and the CLI.
"""

from __future__ import annotations

import re
import subprocess
import sys

import gguf
import pytest
from gguf_craft import FAMILIES, N_TOKENS, Q, T, encode, string, tiny_model, u32

from tokenbudget.engine.loader import check_model_files, load_model_files
from tokenbudget.engine.loader.gguf_file import parse_gguf
from tokenbudget.engine.loader.kv_shape import kv_elements_per_token
from tokenbudget.engine.loader.model_checks import check_gguf_model
from tokenbudget.engine.loader.tensor_layouts import GGUF_LAYOUTS

NAME = "tiny.gguf"


def refused(spec, *fields: str) -> str:
    """``spec`` must fail the checks with a ValueError naming the file and each of ``fields``
    (a field starting with ``re:`` is a regular expression)."""
    with pytest.raises(ValueError) as exc:
        check_gguf_model(parse_gguf(encode(spec), NAME))
    message = str(exc.value)
    assert type(exc.value) is ValueError and message.startswith(f"{NAME}: ") and "\n" not in message, message
    for f in fields:
        assert re.search(f[3:], message) if f.startswith("re:") else f in message, message
    return message


def tiny(arch="llama", **meta):
    """The tiny model with metadata overridden: ``key=(type, value)``, ``None`` removes it;
    a key's dots are written as ``__``."""
    spec = tiny_model(arch)
    for key, v in meta.items():
        key = key.replace("__", ".")
        key = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if v is None:
            del spec.meta[key]
        else:
            spec.meta[key] = v
    return spec


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_family_in_llama_cpp_layout_passes(arch):
    for qtype in (Q.F32, Q.Q8_0):
        dims = check_gguf_model(parse_gguf(encode(tiny_model(arch, qtype)), NAME))
        assert (dims.hidden.value, dims.heads.value, dims.kv_heads.value, dims.head_dim.value) == (32, 4, 2, 8)
        assert (dims.layers.value, dims.vocab.value, dims.ffn.value) == (2, N_TOKENS, 64)


def test_required_tensor_names_are_llama_cpps():
    """Every tensor a layout requires is one llama.cpp's converter writes for that architecture
    (the ``gguf`` package's MODEL_TENSORS)."""
    arch_of = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    for arch, layout in GGUF_LAYOUTS.items():
        known = {gguf.TENSOR_NAMES[t].format(bid=0) for t in gguf.MODEL_TENSORS[arch_of[arch]]}
        for requirement in layout.required:
            for name in requirement.replace("|", " ").split():
                assert name.replace("{i}", "0").rsplit(".", 1)[0] in known, (arch, name)


# ---------------------------------------------------------------- metadata against the tensors


@pytest.mark.parametrize("meta,fields", [
    (dict(embedding_length=(T.UINT32, 48)),
     ("llama.embedding_length = 48", "'token_embd.weight' is 40 x 32, expected vocab x hidden = 40 x 48")),
    (dict(block_count=(T.UINT32, 1)), ("llama.block_count = 1", "layers 0 to 1", "layer 1 is present")),
    (dict(block_count=(T.UINT32, 3)), ("llama.block_count = 3", "layer 2 is missing")),
    (dict(block_count=(T.UINT32, 2**31 - 1)), ("llama.block_count = 2147483647", "layer 2 is missing")),
    (dict(attention__head_count=(T.UINT32, 2)),
     ("'blk.0.attn_k.weight' is 16 x 32", "= 32 x 32", "re:llama\\.attention\\.head_count(?!_kv) = 32 / 2")),
    (dict(attention__head_count_kv=(T.UINT32, 4)), ("'blk.0.attn_k.weight'", "llama.attention.head_count_kv = 4")),
    (dict(attention__key_length=(T.UINT32, 16)),
     ("'blk.0.attn_q.weight' is 32 x 32", "expected (heads * head_dim) x hidden = 64 x 32",
      "llama.attention.key_length = 16")),
    (dict(attention__value_length=(T.UINT32, 4)), ("'blk.0.attn_v.weight'", "llama.attention.value_length = 4")),
    (dict(feed_forward_length=(T.UINT32, 96)),
     ("'blk.0.ffn_gate.weight' is 64 x 32", "llama.feed_forward_length = 96")),
    (dict(rope__dimension_count=(T.UINT32, 6)), ("llama.rope.dimension_count = 6", "rotates whole heads")),
    (dict(tokenizer__ggml__tokens=(T.ARRAY, (T.STRING, ["x"] * 41)),
          tokenizer__ggml__token_type=(T.ARRAY, (T.INT32, [1] * 41))),
     ("'token_embd.weight' is 40 x 32", "tokenizer.ggml.tokens has 41 entries")),
])
def test_metadata_that_contradicts_the_tensors(meta, fields):
    refused(tiny(**meta), *fields)


def test_missing_and_misshapen_tensors():
    spec = tiny_model()
    del spec.tensors["blk.1.attn_v.weight"]
    refused(spec, "'blk.1.attn_v.weight' is missing")
    spec = tiny_model()
    spec.tensors["output.weight"] = ((N_TOKENS - 1, 32), Q.F32)
    refused(spec, "'output.weight' is 39 x 32", "= 40 x 32", "tokenizer.ggml.tokens has 40 entries")
    spec = tiny_model()
    spec.tensors["rope_freqs.weight"] = ((8,), Q.F32)
    refused(spec, "'rope_freqs.weight' is 8", "expected rope_dim // 2 = 4")
    spec = tiny_model()
    del spec.tensors["token_embd.weight"]
    refused(spec, "'token_embd.weight' is missing")


def test_qk_norms_per_head_or_over_all_heads():
    spec = tiny_model("qwen3")  # Qwen3 / Gemma 3: one head_dim vector shared by the heads
    spec.tensors["blk.1.attn_q_norm.weight"] = ((32,), Q.F32)
    refused(spec, "'blk.1.attn_q_norm.weight' is 32", "expected head_dim = 8")
    spec = tiny_model("olmo2")  # OLMo 2: over all heads
    spec.tensors["blk.0.attn_k_norm.weight"] = ((8,), Q.F32)
    refused(spec, "'blk.0.attn_k_norm.weight' is 8", "expected kv_heads * head_dim = 16",
            "olmo2.attention.head_count_kv = 2")


def test_phi3_fused_projections():
    refused(tiny("phi3", feed_forward_length=(T.UINT32, 32)), "'blk.0.ffn_up.weight' is 128 x 32",
            "expected (2 * ffn) x hidden = 64 x 32", "phi3.feed_forward_length = 32")
    refused(tiny("phi3", attention__head_count_kv=(T.UINT32, 1)), "'blk.0.attn_qkv.weight' is 64 x 32",
            "phi3.attention.head_count_kv = 1")
    spec = tiny_model("phi3")
    del spec.tensors["blk.0.attn_qkv.weight"]
    refused(spec, "'blk.0.attn_qkv.weight' is missing", "blk.0.attn_q.weight + blk.0.attn_k.weight")
    split = tiny_model("phi3")  # llama.cpp also reads Phi-3 with split q/k/v
    for i in range(2):
        del split.tensors[f"blk.{i}.attn_qkv.weight"]
        split.tensors.update({f"blk.{i}.attn_q.weight": ((32, 32), Q.F32), f"blk.{i}.attn_k.weight": ((16, 32), Q.F32),
                              f"blk.{i}.attn_v.weight": ((16, 32), Q.F32)})
    check_gguf_model(parse_gguf(encode(split)))
    check_gguf_model(parse_gguf(encode(tiny("phi3", rope__dimension_count=(T.UINT32, 6)))))  # partial rotary


# ---------------------------------------------------------------- value bounds and types


@pytest.mark.parametrize("meta,fields", [
    (dict(context_length=(T.UINT32, 0)), ("llama.context_length = 0 is out of range",)),
    (dict(context_length=(T.UINT32, 2**31)), ("llama.context_length = 2147483648 is out of range",)),
    (dict(context_length=(T.UINT64, 2**40)), ("llama.context_length = 1099511627776",)),
    (dict(embedding_length=(T.UINT64, 2**40)), ("llama.embedding_length = 1099511627776 is out of range",)),
    (dict(embedding_length=(T.STRING, "32")), ("llama.embedding_length must be an integer, got str '32'",)),
    (dict(embedding_length=(T.FLOAT32, 32.0)), ("llama.embedding_length must be an integer, got float",)),
    (dict(embedding_length=(T.BOOL, True)), ("llama.embedding_length must be an integer, got bool",)),
    (dict(embedding_length=(T.ARRAY, (T.UINT32, [32, 32]))), ("llama.embedding_length must be an integer, got list",)),
    (dict(embedding_length=None), ("llama.embedding_length is missing",)),
    (dict(attention__head_count=(T.UINT32, 0)), ("llama.attention.head_count = 0 is out of range",)),
    (dict(attention__head_count=(T.UINT32, 3), attention__head_count_kv=(T.UINT32, 1)),
     ("llama.attention.head_count = 3 does not divide the hidden size 32",)),
    (dict(attention__head_count_kv=(T.UINT32, 3)), ("llama.attention.head_count_kv = 3 does not divide",)),
    (dict(attention__key_length=(T.UINT32, 2**30)), ("llama.attention.key_length", "head dimension of 1073741824")),
    (dict(attention__key_length=(T.UINT32, 7)), ("llama.attention.key_length", "must be even")),
    (dict(rope__dimension_count=(T.UINT32, 9)), ("llama.rope.dimension_count = 9 rotary dimensions",)),
    (dict(attention__layer_norm_rms_epsilon=(T.FLOAT32, float("nan"))), ("llama.attention.layer_norm_rms_epsilon",)),
    (dict(rope__freq_base=(T.FLOAT32, 0.0)), ("llama.rope.freq_base must be a finite positive number",)),
    (dict(tokenizer__ggml__bos_token_id=(T.UINT32, N_TOKENS)), ("tokenizer.ggml.bos_token_id = 40 is not a token id",)),
    (dict(tokenizer__ggml__eos_token_id=(T.INT32, -1)), ("tokenizer.ggml.eos_token_id = -1",)),
    (dict(tokenizer__ggml__tokens=(T.ARRAY, (T.UINT32, list(range(N_TOKENS))))),
     ("tokenizer.ggml.tokens must be an array of str",)),
    (dict(tokenizer__ggml__token_type=(T.ARRAY, (T.INT32, [1] * 3))), ("tokenizer.ggml.token_type has 3 entries",)),
    (dict(tokenizer__ggml__merges=(T.STRING, "a b")), ("tokenizer.ggml.merges must be an array of str",)),
    (dict(general__architecture=(T.UINT32, 1)), ("general.architecture must be a non-empty string",)),
])
def test_values_out_of_bounds_or_of_the_wrong_type(meta, fields):
    refused(tiny(**meta), *fields)


# ---------------------------------------------------------------- the loaders, LLM and the CLI


@pytest.fixture
def no_dequantize(monkeypatch):
    """Fails the test if a tensor is dequantized: the checks must refuse the file before."""
    from tokenbudget.engine.loader import gguf_loader

    def boom(*args, **kwargs):
        raise AssertionError("a tensor was dequantized before the file was checked")
    monkeypatch.setattr(gguf_loader, "dequantize_tensor", boom)


def test_load_model_files_and_kv_shape_refuse_before_dequantizing(tmp_path, no_dequantize):
    path = tmp_path / "bad.gguf"
    path.write_bytes(encode(tiny(attention__key_length=(T.UINT32, 2**30))))
    for call in (load_model_files, check_model_files, kv_elements_per_token):
        with pytest.raises(ValueError, match=f"^{path}: llama.attention.key_length"):
            call(str(path))
    path.write_bytes(encode(tiny_model()))
    assert kv_elements_per_token(str(path)) == 2 * 2 * 8


def patched_default_model(tmp_path, key: str, new: int):
    """A copy of the default model with the u32 metadata value ``key`` set to ``new``."""
    from engine_fixtures import default_model_path_or_skip
    with open(default_model_path_or_skip(), "rb") as f:
        data = bytearray(f.read())
    at = data.index(string(key) + u32(T.UINT32)) + len(string(key)) + 4
    data[at:at + 4] = u32(new)
    path = tmp_path / f"{key}-{new}.gguf"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("key,new,fields", [
    ("llama.attention.head_count", 3, ("'blk.0.attn_k.weight' is 192 x 576", "llama.attention.head_count = 576 / 3")),
    ("llama.block_count", 5, ("llama.block_count = 5", "layers 0 to 29 (30 layers)")),
    ("llama.embedding_length", 1152, ("'token_embd.weight' is 49152 x 576", "llama.embedding_length = 1152")),
    ("llama.context_length", 2**31, ("llama.context_length = 2147483648 is out of range",)),
])
def test_llm_refuses_the_issues_default_model_variants(tmp_path, no_dequantize, key, new, fields):
    from tokenbudget import LLM
    path = patched_default_model(tmp_path, key, new)
    with pytest.raises(ValueError) as exc:
        LLM(model=path, num_threads=1, kv_cache_memory_bytes=16 << 20)
    assert str(exc.value).startswith(f"{path}: ")
    for f in fields:
        assert f in str(exc.value)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_prints_one_line_and_exits_2(tmp_path, command):
    path = patched_default_model(tmp_path, "llama.block_count", 5)
    argv = ["generate", "--model", path, "hi"] if command == "generate" else ["serve", path, "--port", "0"]
    res = subprocess.run([sys.executable, "-m", "tokenbudget", *argv], capture_output=True, text=True, timeout=300)
    lines = res.stderr.strip().splitlines()
    prefix = "tokenbudget: error: " + ("model: " if command == "serve" else "")
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"{prefix}{path}: llama.block_count = 5"), lines[0]
