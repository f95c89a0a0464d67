"""Model loading: GGUF dequantization, GGUF/HF directory loading, default model, SmolLM2 end to end."""

from __future__ import annotations

import subprocess

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as np_dequantize
from gguf.quants import quantize as np_quantize
from tokenizers import pre_tokenizers

from tokenbudget.engine.loader import LoadedModel, load_model_files
from tokenbudget.engine.loader import default_model as dm
from tokenbudget.engine.loader.gguf_config import llama3_rope_scaling_from_freqs
from tokenbudget.engine.loader.gguf_dequant import dequantize_tensor
from tokenbudget.engine.loader.gguf_loader import gguf_tensor_name_to_hf, unpermute_qk
from tokenbudget.engine.loader.hf_config import hf_config_to_model_config

from model_helpers import hf_llama_from_loaded, write_tokenizer_files  # noqa: E402

# ---------------------------------------------------------------- dequantization


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_torch_dequant_matches_gguf_numpy(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 5, (6, 1))).astype(np.float32)
    data = np_quantize(x, qtype)
    ref = torch.from_numpy(np.asarray(np_dequantize(data, qtype), dtype=np.float32))
    got = dequantize_tensor(data, qtype)
    assert got.shape == (6, 512) and got.dtype == torch.float32
    assert torch.equal(got, ref)
    assert dequantize_tensor(data, qtype, torch.bfloat16).dtype == torch.bfloat16


def _random_k_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks whose f16 scale fields are small finite numbers."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.1, (n_blocks, 2)).astype(np.float16).view(np.uint8)
    offset = {Q.Q2_K: 80, Q.Q3_K: 108, Q.Q4_K: 0, Q.Q5_K: 0, Q.Q6_K: 208}[qtype]
    raw[:, offset:offset + (4 if qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K) else 2)] = \
        scales[:, :4 if qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K) else 2]
    return raw.reshape(2, -1)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_dequantize(qtype: Q) -> None:
    raw = _random_k_blocks(qtype, 4, np.random.default_rng(0))
    got = dequantize_tensor(raw, qtype)
    ref = torch.from_numpy(np.asarray(np_dequantize(raw, qtype), dtype=np.float32))
    assert got.shape == (2, 512)
    assert torch.equal(got, ref) and torch.isfinite(got).all()


def test_unsupported_type_is_clear() -> None:
    with pytest.raises(NotImplementedError):
        dequantize_tensor(np.zeros((1, 36), dtype=np.uint8), Q.Q8_1)


# ---------------------------------------------------------------- GGUF files written here


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's permute of q/k rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
    assert torch.equal(unpermute_qk(torch.from_numpy(_permute(w, 6)), 6), torch.from_numpy(w))
    assert gguf_tensor_name_to_hf("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert gguf_tensor_name_to_hf("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_tensor_name_to_hf("output.weight") == "lm_head.weight"
    assert gguf_tensor_name_to_hf("blk.0.weird.weight") is None


_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _hf_to_gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")  # model.layers.i.(self_attn|mlp).x.weight or model.layers.i.norm.weight
    key = parts[-2] if parts[-2] in _GGUF_NAMES else parts[3]
    return f"blk.{parts[2]}.{_GGUF_NAMES[key]}.{parts[-1]}"


def _write_gguf(path: str, arch: str, sd: dict[str, torch.Tensor], cfg: dict, qtype: Q) -> None:
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<s>", "</s>", "<|im_end|>"]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["layers"])
    w.add_context_length(256)
    w.add_embedding_length(cfg["hidden"])
    w.add_feed_forward_length(cfg["ffn"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, t in sd.items():
        a = t.detach().float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            a = _permute(a, cfg["heads"] if ".q_proj." in name else cfg["kv_heads"])
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(_hf_to_gguf_name(name), np_quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_hf_to_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_hf_model(kind: str, tied: bool = False):
    common = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                  max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))


@pytest.mark.parametrize("arch,tied,qtype", [("llama", False, Q.F32), ("llama", True, Q.Q8_0),
                                             ("qwen2", False, Q.F32)])
def test_gguf_file_roundtrip(tmp_path, arch: str, tied: bool, qtype: Q) -> None:
    model = _tiny_hf_model(arch, tied)
    sd = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(path, arch, sd, dict(layers=2, hidden=64, ffn=96, heads=4, kv_heads=2), qtype)
    loaded = load_model_files(path)
    assert isinstance(loaded, LoadedModel) and loaded.source == path
    c = loaded.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers) == (arch, 259, 64, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.rope_theta == 5000.0 and c.tie_word_embeddings == tied
    assert c.attention_bias == (arch == "qwen2")
    assert (c.bos_token_id, c.eos_token_id) == (256, 257)
    assert set(loaded.state_dict) == set(sd)
    for name, ref in sd.items():
        got = loaded.state_dict[name]
        assert got.shape == ref.shape, name
        if qtype == Q.F32 or ref.ndim == 1:
            assert torch.equal(got, ref.float()), name
        else:
            assert torch.allclose(got, ref.float(), atol=float(ref.abs().max()) / 64), name
    assert loaded.tokenizer.eos_token_id == 257


def test_llama3_rope_freqs_recovered() -> None:
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, rope_theta=500000.0,
                                   rope_scaling=dict(scaling), max_position_embeddings=131072)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    inv = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    got = llama3_rope_scaling_from_freqs((inv / inv_scaled.double()).float(), 500000.0, 64)
    assert got == scaling
    assert llama3_rope_scaling_from_freqs(torch.ones(32), 500000.0, 64) is None


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize("kind,tied", [("llama", False), ("mistral", False), ("qwen2", False),
                                       ("llama", True)])
def test_hf_dir_state_dict_equal(tmp_path, kind: str, tied: bool) -> None:
    model = _tiny_hf_model(kind, tied)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards + index
    write_tokenizer_files(tmp_path)
    loaded = load_model_files(str(tmp_path))
    ref = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(loaded.state_dict) == set(ref)
    for k, v in ref.items():
        assert torch.equal(loaded.state_dict[k], v), k
    c = loaded.config
    assert c.architecture == kind and c.tie_word_embeddings == tied
    assert c.attention_bias == (kind == "qwen2")
    assert c.num_key_value_heads == 2 and c.resolved_head_dim == 16
    half = load_model_files(str(tmp_path), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.state_dict.values())


def test_hf_config_variants() -> None:
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    old = hf_config_to_model_config({**base, "rope_theta": 5e5, "rope_scaling": {
        "type": "linear", "factor": 2.0}})
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.num_key_value_heads == 2
    new = hf_config_to_model_config({**base, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e6}})
    assert new.rope_theta == 1e6 and new.rope_scaling["rope_type"] == "yarn"
    assert hf_config_to_model_config({**base, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4}}).rope_scaling is None
    eos = hf_config_to_model_config({**base, "eos_token_id": 2}, {"eos_token_id": [2, 7]})
    assert eos.eos_token_ids == [2, 7]
    with pytest.raises(ValueError, match="model_type"):
        hf_config_to_model_config({**base, "model_type": "gpt2"})


def test_missing_model_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model_files(str(tmp_path / "nope.gguf"))
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match=".gguf"):
        load_model_files(str(tmp_path / "x.bin"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_files(str(tmp_path))


# ---------------------------------------------------------------- default model


def test_default_model_cached_and_offline_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENBUDGET_CACHE", str(tmp_path))
    (tmp_path / dm.DEFAULT_MODEL_FILENAME).write_bytes(b"x")
    assert dm.default_model_path() == str(tmp_path / dm.DEFAULT_MODEL_FILENAME)
    (tmp_path / dm.DEFAULT_MODEL_FILENAME).unlink()

    def offline(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: network is unreachable\n")

    monkeypatch.setattr(dm.subprocess, "run", offline)
    with pytest.raises(RuntimeError, match="--model"):
        dm.default_model_path()
    assert not (tmp_path / dm.DEFAULT_MODEL_FILENAME).exists()


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    from engine_fixtures import default_model_path_or_skip
    return load_model_files(default_model_path_or_skip())


def test_smollm2_config(smollm2: LoadedModel) -> None:
    c = smollm2.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("llama", 49152, 576, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.resolved_head_dim) == (9, 3, 64)
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm2.state_dict
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.eos_token_ids == [2] and smollm2.tokenizer.eos_token_id == 2


def test_smollm2_greedy_generation_says_paris(smollm2: LoadedModel) -> None:
    """Proves name mapping, dequantization and the q/k un-permute (wrong rows -> gibberish)."""
    model = hf_llama_from_loaded(smollm2)
    tok = smollm2.tokenizer
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:].tolist())
