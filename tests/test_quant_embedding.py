"""The token embedding of a quantized model is kept as GGUF Q8_0 rows (``Q8Embedding``) when that
form holds its values exactly: a quarter of the float table's memory (the default model's largest
tensor left in RAM: 113 MB as fp32), and every lookup returns the float table's rows bit for bit,
so nothing the model computes changes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.quant import Q8Embedding, quantize_model

import batch_schedules as bs


def _q8_0_roundtrip(table: torch.Tensor) -> torch.Tensor:
    """What llama.cpp's quantize_row_q8_0 then dequantize gives (d = amax / 127 stored in fp16)."""
    blocks = table.view(table.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, 0.0)).clamp(-127, 127)
    return (q * d.half().float()).view_as(table)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 6), seed=st.integers(0, 2**31 - 1),
       zero_block=st.booleans())
def test_a_q8_0_table_is_held_exactly(rows, groups, seed, zero_block):
    g = torch.Generator().manual_seed(seed)
    table = _q8_0_roundtrip(torch.randn(rows, 32 * groups, generator=g) * 0.05)
    if zero_block:
        table[0, :32] = 0
    emb = Q8Embedding.exact_from(table)
    assert emb is not None and emb.shape == table.shape and emb.nbytes() < table.numel() * 4 / 3
    ids = torch.randint(0, rows, (17,), generator=g)
    assert torch.equal(emb[ids], table[ids])
    assert torch.equal(emb[ids.view(1, -1)], table[ids.view(1, -1)])  # any index shape, like a tensor


def test_a_table_it_cannot_hold_exactly_is_refused():
    table = torch.randn(8, 64)
    assert Q8Embedding.exact_from(table) is None                      # arbitrary floats
    assert Q8Embedding.exact_from(_q8_0_roundtrip(table)[:, :48]) is None  # not whole groups of 32
    assert Q8Embedding.exact_from(_q8_0_roundtrip(table).double()) is None


def test_quantize_model_keeps_the_float_table_unless_exact():
    sd = bs.random_state_dict(bs.CFG)
    model = quantize_model(build_model(bs.CFG, dict(sd), torch.float32, "cpu"), "int8")
    assert isinstance(model.embed, torch.Tensor)                       # random floats: kept as they are
    sd["model.embed_tokens.weight"] = _q8_0_roundtrip(sd["model.embed_tokens.weight"].float())
    ref = build_model(bs.CFG, dict(sd), torch.float32, "cpu")
    model = quantize_model(build_model(bs.CFG, dict(sd), torch.float32, "cpu"), "int8")
    assert isinstance(model.embed, Q8Embedding)
    ids = torch.arange(bs.CFG.vocab_size)
    assert torch.equal(model.embed[ids], ref.embed[ids])


def test_the_default_model_embedding_is_q8_and_exact(c_kernels):
    from tokenbudget.engine.loader import LoadedModel
    from tokenbudget.engine.loader.target import build_target

    from engine_fixtures import default_loaded
    base = default_loaded()
    table = base.state_dict["model.embed_tokens.weight"]
    copy = LoadedModel(base.config, dict(base.state_dict), base.tokenizer, base.source, base.weight_type)
    model = build_target(copy, torch.float32, torch.device("cpu"), "auto").model  # the engine's default
    assert isinstance(model.embed, Q8Embedding)
    assert model.embed.nbytes() * 3 < table.numel() * 4                # 30 MB instead of 113 MB
    ids = torch.arange(table.shape[0])
    assert torch.equal(model.embed[ids], table.float())
