"""``benches/gpu_row_check.py`` (``gpu_spec --check-rows``) on CPU: it finds no unequal row where
the backend is row-invariant (torch_ref), and flags the row that differs where one does."""

from __future__ import annotations

import torch

from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.attention.torch_ref import TorchRefBackend

from benches.gpu_check_attention import Pool, run_batch
from benches.gpu_row_check import RowCheck

SPEC = AttentionSpec(4, 2, 16, 16, torch.float32)


def _verify(backend, seed: int = 0) -> None:
    """One step: a 3-row verify ending at position 40, beside a decode at position 20."""
    pool = Pool(SPEC, 16, "cpu", seed)
    tables = [pool.request(41), pool.request(21)]
    q, k, v = pool.rand(4, 4, 16), pool.rand(4, 2, 16), pool.rand(4, 2, 16)
    run_batch(backend, pool, [(3, 41, tables[0]), (1, 21, tables[1])], q, k, v)


def test_equal_rows_pass_and_the_hook_comes_off() -> None:
    backend = TorchRefBackend(SPEC, "cpu")
    check = RowCheck(backend, num_layers=1)
    _verify(backend)
    assert (check.rows_checked, check.rows_unequal, check.records) == (3, 0, [])  # the decode is not a verify
    check.uninstall()
    _verify(backend)
    assert check.rows_checked == 3


def test_a_row_that_differs_is_recorded() -> None:
    backend = TorchRefBackend(SPEC, "cpu")
    check = RowCheck(backend, num_layers=2)
    attend = check._attend

    def off_by_a_bit(q, kv_cache, md):  # the engine's row 1 of the verify, one ulp off
        out = attend(q, kv_cache, md).clone()
        out[1] = torch.nextafter(out[1], torch.full_like(out[1], float("inf")))
        return out

    check._attend = off_by_a_bit
    _verify(backend)
    _verify(backend)
    assert check.rows_unequal == 2
    assert [(r["step"], r["layer"], r["request"], r["row"], r["kv_len"]) for r in check.records] == \
        [(0, 0, 0, 1, 41), (0, 1, 0, 1, 41)]
