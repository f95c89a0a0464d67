"""The CPU reference attention is row-invariant whatever GEMM kernel the BLAS picks.

Issue 26 (N5, CPU part): ``gpu_check --device cpu --sections row_invariance`` reported an
8B-layout (GQA-4) decode row differing from row 0 of the verify that covers it, on torch_ref.
The reference relied on MKL's optimized sgemm giving a row the same bits for every row count
M >= 4; that is a property of one code path on one CPU, not of a GEMM. MKL's portable code path
(``MKL_CBWR=COMPATIBLE``, any x86 CPU) breaks it for every layout, so it stands in here for "a
BLAS whose kernel choice depends on M": each check runs under the default path (in process)
and under the portable one (in a child process, the variable is read when MKL loads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenbudget.kernels.attention.base import AttentionSpec
from tokenbudget.kernels.attention.torch_ref import TorchRefBackend
from tokenbudget.kernels.kv_write import write_kv_reference

from benches.gpu_check_attention import Pool, run_batch

LAYOUTS = [(32, 8, 128), (9, 3, 64), (8, 2, 64), (8, 1, 64), (16, 2, 64)]  # 8B, default, ...


def decode_vs_verify_vs_prefill(num_heads: int, num_kv_heads: int, head_dim: int) -> list[str]:
    """Row of position ``c - k`` computed as a 1-row decode, inside a (1 + k)-row verify and inside
    a 70-row prefill chunk (many 4-row blocks); returns the mismatches."""
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, 16, torch.float32)
    backend, bad = TorchRefBackend(spec, "cpu"), []
    for c in (100, 300):
        pool = Pool(spec, 2 * (c // 16 + 2), "cpu", seed=c)
        table = pool.request(c)
        q = pool.rand(70, num_heads, head_dim)
        kk, vv = pool.rand(70, num_kv_heads, head_dim), pool.rand(70, num_kv_heads, head_dim)
        slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(c - 69, c + 1)])
        write_kv_reference(kk, vv, pool.cache, slots)  # every run sees the chunk's keys
        chunk = run_batch(backend, pool, [(70, c + 1, table)], q, kk, vv)
        for k in (1, 3, 4, 8):
            r = 70 - 1 - k  # row of position c - k in the chunk
            verify = run_batch(backend, pool, [(1 + k, c + 1, table)], q[r:], kk[r:], vv[r:])
            decode = run_batch(backend, pool, [(1, c - k + 1, table)], q[r:r + 1], kk[r:r + 1],
                               vv[r:r + 1])
            if not torch.equal(decode[0], verify[0]):
                bad.append(f"c={c} k={k}: decode != verify row 0")
            if not torch.equal(decode[0], chunk[r]):
                bad.append(f"c={c} k={k}: decode != prefill-chunk row")
    return bad


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_bitwise_default_blas_path(layout):
    assert decode_vs_verify_vs_prefill(*layout) == []


def test_rows_bitwise_portable_blas_path():
    code = ("import json, sys; sys.path.insert(0, 'tests'); "
            "from test_attention_row_blocks import LAYOUTS, decode_vs_verify_vs_prefill as f; "
            "print(json.dumps({str(lay): f(*lay) for lay in LAYOUTS}))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MKL_CBWR="COMPATIBLE")
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    assert found == {str(lay): [] for lay in LAYOUTS}
