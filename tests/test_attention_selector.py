"""The selector falls back to torch_ref, with the reason logged, wherever FlashInfer refuses."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.attention.selector import select_attention_backend

import flashinfer_standin

BF16 = AttentionSpec(4, 2, 128, 16, torch.bfloat16)


@pytest.fixture
def installed(monkeypatch):
    """``flashinfer`` importable (the stand-in), so only the spec decides."""
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin)
    monkeypatch.setattr(flashinfer_standin, "__spec__",
                        importlib.machinery.ModuleSpec("flashinfer", None), raising=False)


@pytest.mark.parametrize("spec, reason", [
    (AttentionSpec(4, 2, 128, 16, torch.float32), "float16/bfloat16"),
    (AttentionSpec(4, 2, 32, 16, torch.bfloat16), "head_dim 32 < 64"),
])
def test_refused_specs_fall_back_with_reason(installed, caplog, spec, reason):
    with caplog.at_level(logging.INFO, logger="tokenbudget.kernels.attention.selector"):
        backend = select_attention_backend("cuda", spec)
    assert backend.name == "torch_ref"
    assert reason in caplog.text and "flashinfer refused" in caplog.text


class _Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "flashinfer" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError("libcudart.so.12: cannot open shared object file")


def test_import_failure_falls_back_with_reason(monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Broken(), *sys.meta_path])
    with caplog.at_level(logging.INFO, logger="tokenbudget.kernels.attention.selector"):
        backend = select_attention_backend("cuda", BF16)
    assert backend.name == "torch_ref"
    assert "libcudart" in caplog.text


def test_cuda_extra_pins_what_the_backend_is_written_against():
    """The ``cuda`` extra pins exactly the FlashInfer release the backend and docs/cuda.md name,
    and the same triton as ``.ci/run`` installs for the Triton-interpreter tests (the ``test`` extra
    pins none: it would conflict with a CUDA torch's own triton); bumping one alone fails here."""
    root = Path(__file__).parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def pins(extra: str) -> dict[str, str]:
        return {name: ver for name, _, ver in (d.partition("==") for d in extras[extra]) if ver}
    cuda = pins("cuda")
    backend_doc = (root / "kernels" / "attention" / "flashinfer_backend.py").read_text()
    written_against = re.search(r"written against flashinfer-python ([0-9][\w.]*\w)", backend_doc).group(1)
    assert cuda["flashinfer-python"] == written_against
    assert f"`flashinfer-python=={written_against}`" in (root / "docs" / "cuda.md").read_text()
    ci_triton = re.search(r"pip install -q triton==([0-9][\w.]*)", (root / ".ci" / "run").read_text()).group(1)
    assert cuda["triton"] == ci_triton and "triton" not in pins("test")
    assert {"ninja", "nvidia-ml-py"} <= set(extras["cuda"])  # the JIT's and device queries' runtime needs
