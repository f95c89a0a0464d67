"""Engine test plumbing shared by the end-to-end test files (imported, not a conftest).

The default GGUF is read and dequantized once per test process (``default_loaded``, its state
dict kept for comparisons with transformers) and built into one ``TargetModel``
(``default_target``) that every engine of the process shares: engines only read weights.
"""

from __future__ import annotations

import functools

import pytest
import torch

ENGINE_OPTS = dict(num_threads=1, kv_cache_memory_bytes=64 << 20, max_model_len=512)


def default_model_path_or_skip() -> str:
    """The default GGUF's cached path, fetched if needed.

    Skips only when the file is neither cached nor downloadable (offline), and the skip says so;
    anything else (a checksum mismatch, an unreadable cache) raises: a failure, never a skip.
    Under CI=true even that skip fails the run (tests/conftest.py): CI has the network.
    """
    from tokenbudget.engine.loader.default_model import cache_dir, default_model_path
    try:
        return default_model_path()
    except RuntimeError as exc:
        if not str(exc).startswith("could not download the default model"):
            raise
        pytest.skip(f"default model neither cached in {cache_dir()} nor downloadable: {exc}")


@functools.cache
def default_loaded():
    """The default model's files, fp32. Skips only where the file cannot be had
    (``default_model_path_or_skip``); an error in parsing, dequantizing or the tokenizer fails."""
    from tokenbudget.engine.loader import load_model_files
    return load_model_files(default_model_path_or_skip())


@functools.cache
def default_target():
    """The default model built once (fp32, CPU); pass it as ``LLM(default_target(), ...)``."""
    from tokenbudget.engine.loader import LoadedModel
    from tokenbudget.engine.loader.target import build_target
    base = default_loaded()
    copy = LoadedModel(base.config, dict(base.state_dict), base.tokenizer, base.source, base.weight_type)
    return build_target(copy, torch.float32, torch.device("cpu"))


def assert_all_blocks_free(engine) -> None:
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()
