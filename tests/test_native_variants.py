"""Which C kernel variant runs (kernels/cpu/native.py) and that the start-up line says so.

``TOKENBUDGET_NATIVE``: unset takes the best SIMD variant the CPU executes (without one: the
portable ``scalar`` on x86, torch's kernels elsewhere), a name forces one, a bad name or a variant the CPU
cannot execute is a ValueError naming the variable; the start-up line names the variant (before:
"attention backend: torch_ref" although the C forward did the attention, and nothing about the
kernels), or torch's kernels and why.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.cpu_forward import kernels_summary
from tokenbudget.engine.model.quant import quantize_model
from tokenbudget.kernels.cpu import native

import batch_schedules as bs


def test_a_bad_variant_name_is_a_value_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("TOKENBUDGET_NATIVE", "avx1024")
    with pytest.raises(ValueError, match="TOKENBUDGET_NATIVE='avx1024'.*avx2"):
        native.selected_variant()


def test_a_variant_the_cpu_cannot_execute_is_refused_naming_what_is_missing(monkeypatch):
    foreign = "neon" if native.machine() != "aarch64" else "avx2"
    monkeypatch.setenv("TOKENBUDGET_NATIVE", foreign)
    with pytest.raises(ValueError, match=f"TOKENBUDGET_NATIVE={foreign}: this CPU cannot execute it"):
        native.selected_variant()


def test_auto_takes_the_best_simd_variant_and_scalar_only_on_x86(monkeypatch):
    monkeypatch.delenv("TOKENBUDGET_NATIVE", raising=False)
    best = native.runnable_variants()[0]
    assert native.selected_variant() == (None if best == "scalar" and native.machine() != "x86_64" else best)
    monkeypatch.setattr(native, "runnable_variants", lambda: ["scalar"])
    monkeypatch.setattr(native, "machine", lambda: "x86_64")   # no AVX2: torch has no vector path either
    assert native.selected_variant() == "scalar"
    monkeypatch.setattr(native, "machine", lambda: "aarch64")  # no dot product: torch's NEON kernels
    assert native.selected_variant() is None
    assert "TOKENBUDGET_NATIVE=scalar" in native.unavailable_reason()
    monkeypatch.setenv("TOKENBUDGET_NATIVE", "0")
    assert native.selected_variant() is None and native.unavailable_reason() == "TOKENBUDGET_NATIVE=0"


def test_kernels_summary_names_the_variant_or_why_torch(variant, monkeypatch):
    model = quantize_model(build_model(bs.CFG, bs.random_state_dict(bs.CFG), torch.float32, "cpu"), "int4")
    assert kernels_summary(model) == f"C {variant} (GEMMs and the decoder forward)"
    monkeypatch.setenv("TOKENBUDGET_NATIVE", "0")
    model = quantize_model(build_model(bs.CFG, bs.random_state_dict(bs.CFG), torch.float32, "cpu"), "int4")
    assert kernels_summary(model) == "torch's quantized kernels (TOKENBUDGET_NATIVE=0)"


@pytest.mark.isa
def test_start_up_line_names_the_kernel_variant(caplog):
    """The default model as it ships (Q4_1 GGUF -> int4) on the variant this CPU runs."""
    from tokenbudget import LLM
    from tokenbudget.engine.loader import LoadedModel
    from tokenbudget.engine.loader.target import build_target

    from engine_fixtures import default_loaded
    variant = native.selected_variant()
    if variant is None:
        pytest.skip(f"CPU lacks {', '.join(native.missing('avx2'))} (C kernel variant avx2)")
    base = default_loaded()
    copy = LoadedModel(base.config, dict(base.state_dict), base.tokenizer, base.source, base.weight_type)
    target = build_target(copy, torch.float32, torch.device("cpu"), "auto")
    with caplog.at_level(logging.INFO, logger="tokenbudget"):
        LLM(target, num_threads=1, max_num_seqs=2, max_model_len=256)
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"kernels: C {variant} (GEMMs and the decoder forward)" in m for m in lines if "KV blocks" in m)
    assert any(f"attention: the C decoder forward ({variant})" in m for m in lines)
    assert not any("attention backend: torch_ref" in m for m in lines)
