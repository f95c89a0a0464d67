"""The C decoder forward is installed around a quantized model (``CpuForwardModel``), not as a
branch inside the model code, and a view of the model's first layers (self-drafting) gets a C
forward of its own: before, the view kept the whole model's forward and read past its layer
table (a segfault with ``speculative_config={"method": "self_draft"}`` on the default model)."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from tokenbudget.engine.drafters.draft_runner import truncated_view
from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.cpu_forward import CpuForwardModel
from tokenbudget.engine.model.quant import quantize_model

import batch_schedules as bs

pytestmark = pytest.mark.usefixtures("c_kernels")  # conftest: a skip names the missing CPU flag; a failed build fails

CFG = ModelConfig(vocab_size=101, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)


def test_quantize_model_installs_the_c_forward_around_the_model():
    model = quantize_model(build_model(CFG, bs.random_state_dict(CFG), torch.float32, "cpu"), "int8")
    assert isinstance(model, CpuForwardModel) and model.cpu_forward is not None
    assert not hasattr(model.model, "cpu_forward")  # the model code knows nothing of it


def test_a_view_of_the_first_layers_runs_those_layers_in_c(monkeypatch):
    model = quantize_model(build_model(CFG, bs.random_state_dict(CFG, seed=4), torch.float32, "cpu"), "int4")
    view = truncated_view(model, 1)
    assert isinstance(view, CpuForwardModel) and view.cpu_forward is not None
    monkeypatch.setattr(bs, "CFG", msgspec.structs.replace(CFG, num_hidden_layers=1))
    rng = random.Random(2)
    seqs = [[rng.randrange(CFG.vocab_size) for _ in range(n)] for n in (5, 40)]
    native = bs.run_schedule(view, seqs, bs.SCHEDULES["random_chunks"], torch.float32, 0)
    view.cpu_forward = None
    torch_path = bs.run_schedule(view, seqs, bs.SCHEDULES["random_chunks"], torch.float32, 0)
    for a, b in zip(native, torch_path):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert (a - b).abs().max() <= 1e-2 * b.abs().max()
