"""Engine test plumbing shared by the end-to-end test files (imported, not a conftest).

The default GGUF is read and dequantized once per test process and kept on the
``engine.loader`` module; ``reuse_default_weights`` hands each engine built inside it a fresh
state-dict over those tensors (the builder clears the dict it is given).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

ENGINE_OPTS = dict(num_threads=1, kv_cache_memory_bytes=64 << 20, max_model_len=512)


def _default_model_once():
    """The default GGUF read and dequantized once per test process (about 12 s each time saved).

    Kept on the ``engine.loader`` module object so every test file of the process shares it.
    The builder clears the state-dict it is handed, so each engine gets a fresh dict of the same
    (never mutated) tensors.
    """
    import tokenbudget.engine.loader as loader
    cached = getattr(loader, "_tests_default_fp32", None)
    if cached is None:
        try:
            cached = loader.load_model_files(None)
        except RuntimeError as exc:  # offline and nothing cached
            pytest.skip(f"default model unavailable: {exc}")
        loader._tests_default_fp32 = cached
    return cached


@contextlib.contextmanager
def reuse_default_weights():
    import tokenbudget.engine.core.builder as builder
    from tokenbudget.engine.loader import LoadedModel
    real = builder.load_model_files
    base = _default_model_once()

    def load(model, dtype=torch.float32):
        if model is None and dtype == torch.float32:
            return LoadedModel(base.config, dict(base.state_dict), base.tokenizer, base.source)
        return real(model, dtype=dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "load_model_files", load)
        yield


def assert_all_blocks_free(engine) -> None:
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()
