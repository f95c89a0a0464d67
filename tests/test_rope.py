"""Our RoPE tables against transformers' rotary embeddings, for every supported ``rope_type``.

transformers computes cos/sin per forward from the positions it is given; two types depend on the
sequence length (``engine/model/rope.py`` says how the table fixes them per position): ``dynamic``
must equal transformers for any sequence that fits ``max_position_embeddings``, and ``longrope``
must equal transformers' short factors below ``original_max_position_embeddings`` and its long
factors from there on (what transformers uses for a sequence longer than the original).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenbudget.engine.model.rope import RotaryTable, check_rope_scaling

HEAD_DIM, MAX_POS = 16, 256
CASES = {
    "default": ("llama", {"rope_type": "default"}, 1.0),
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}, 1.0),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 4.0}, 1.0),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}, 1.0),
    "yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 1.0),
    "longrope_partial": ("phi3", {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                  "long_factor": [1.0, 4.0, 8.0, 16.0], "original_max_position_embeddings": 64},
                         0.5),
}


def _hf_cos_sin(model_type: str, params: dict, factor: float, positions: torch.Tensor):
    cfg = transformers.AutoConfig.for_model(
        model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS, partial_rotary_factor=factor,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": factor, **params},
        **({"original_max_position_embeddings": params["original_max_position_embeddings"]}
           if model_type == "phi3" else {}))
    module = transformers.AutoModelForCausalLM.from_config(cfg).model.rotary_emb
    x = torch.zeros(1, len(positions), 64)
    cos, sin = module(x, positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("case", list(CASES))
def test_table_matches_transformers(case) -> None:
    model_type, params, factor = CASES[case]
    table = RotaryTable(HEAD_DIM, 10000.0, params, MAX_POS, torch.float32, "cpu",
                        rotary_dim=int(HEAD_DIM * factor), positions=MAX_POS)
    orig = params.get("original_max_position_embeddings", MAX_POS)
    short = torch.arange(min(orig, MAX_POS) if params["rope_type"] == "longrope" else MAX_POS)
    cos, sin = _hf_cos_sin(model_type, params, factor, short)
    half = table.half
    torch.testing.assert_close(table.cos[short], cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(table.sin[short, half:], sin[:, half:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(table.sin[short, :half], -sin[:, :half], rtol=1e-6, atol=1e-6)
    if params["rope_type"] == "longrope":  # a sequence past the original: the long factors
        every = torch.arange(MAX_POS)
        cos, sin = _hf_cos_sin(model_type, params, factor, every)
        torch.testing.assert_close(table.cos[orig:], cos[orig:], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(table.sin[orig:, half:], sin[orig:, half:], rtol=1e-6, atol=1e-6)


def test_table_grows_on_reserve_only_up_to_the_model_context() -> None:
    table = RotaryTable(HEAD_DIM, 10000.0, None, 2**40, torch.float32, "cpu")  # a hostile context length
    assert table.cos.shape[0] == 4096  # not 2**40 rows
    table.reserve(5000)
    assert table.cos.shape[0] == table.max_pos == 5000
    small = RotaryTable(HEAD_DIM, 10000.0, None, 100, torch.float32, "cpu", positions=10**6)
    assert small.max_pos == 100


@pytest.mark.parametrize("bad, key", [
    ({"rope_type": "made_up"}, "rope_type"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64},
     "high_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 8,
      "original_max_position_embeddings": 64}, "short_factor"),
])
def test_bad_rope_scaling_names_the_key(bad, key) -> None:
    with pytest.raises(ValueError, match=key):
        check_rope_scaling(bad, HEAD_DIM)
