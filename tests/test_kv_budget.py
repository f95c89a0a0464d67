"""The default KV pool: sized from the model, ``max_num_seqs`` and the machine; resident only as
it fills on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.worker import kv_cache_alloc as kva
from tokenbudget.engine.worker.host_memory import available_memory_bytes, resident_memory_bytes

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
CPU = torch.device("cpu")


def test_budget_is_what_the_sequences_need_when_memory_allows(monkeypatch):
    monkeypatch.setattr(kva, "available_memory_bytes", lambda: 64 << 30)
    per_block = kva.kv_cache_block_bytes(CFG, 16, torch.float32)
    assert kva.default_kv_cache_bytes(CFG, 16, torch.float32, CPU, 8, None) == 8 * (1024 // 16) * per_block
    assert kva.default_kv_cache_bytes(CFG, 16, torch.float32, CPU, 8, 100) == 8 * 7 * per_block


def test_budget_is_capped_by_available_memory_and_the_cpu_cap(monkeypatch):
    monkeypatch.setattr(kva, "available_memory_bytes", lambda: 40 << 20)
    assert kva.default_kv_cache_bytes(CFG, 16, torch.float32, CPU, 4096, None) == (40 << 20) // 4
    monkeypatch.setattr(kva, "available_memory_bytes", lambda: 1 << 40)
    assert kva.default_kv_cache_bytes(CFG, 16, torch.float32, CPU, 10**6, None) == kva.CPU_KV_CAP
    monkeypatch.setattr(kva, "available_memory_bytes", lambda: 1)  # at least one block
    assert kva.default_kv_cache_bytes(CFG, 16, torch.float32, CPU, 4, None) == kva.kv_cache_block_bytes(
        CFG, 16, torch.float32)


def test_cpu_pool_is_resident_only_as_it_fills():
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("/proc/self/statm missing: this OS gives no resident-set size to read")
    before = resident_memory_bytes()
    assert before is not None, "/proc/self/statm exists but resident_memory_bytes() could not read it"
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)
    num_blocks = (512 << 20) // kva.kv_cache_block_bytes(cfg, 16, torch.float32)  # a 512 MiB pool
    caches = kva.allocate_kv_caches(cfg, num_blocks, 16, torch.float32, "cpu")
    assert resident_memory_bytes() - before < 64 << 20
    caches[0][:10].fill_(1.0)  # writing a few blocks makes only those resident
    assert resident_memory_bytes() - before < 64 << 20


def test_engine_reports_its_pool_and_rss(caplog):
    import logging

    from tokenbudget import LLM

    from engine_fixtures import default_target
    with caplog.at_level(logging.INFO, logger="tokenbudget"):
        LLM(default_target(), num_threads=1, max_num_seqs=2, max_model_len=256)
    line = next(r.getMessage() for r in caplog.records if "KV blocks" in r.getMessage())
    assert "GiB)" in line and "RSS" in line
    assert available_memory_bytes() > 0
