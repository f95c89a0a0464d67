"""Triton slot-mapping K/V write == its torch reference.

Without CUDA the kernel runs under Triton's interpreter. ``TRITON_INTERPRET=1`` must be
set before a kernel is decorated, and the rest of the suite must not see it, so the
interpreter check runs in a child process (``runpy`` on this file, then the named
``_check_*`` function). With CUDA the same checks also run in-process on the GPU.
Everything skips when triton is not installed.
"""

from __future__ import annotations

import pytest
import torch

from tokenbudget.kernels.kv_write import write_kv, write_kv_reference

from triton_interp import needs_cuda, needs_triton, run_interpreted  # noqa: E402


def _run_interpreted(func_name: str, *args) -> None:
    run_interpreted(__file__, globals(), func_name, *args)


def _case(seed: int, device: str, num_tokens: int, heads: int, head_dim: int,
          block_size: int, num_blocks: int, src_dtype, cache_dtype):
    g = torch.Generator().manual_seed(seed)
    # k/v as strided views into a fused qkv buffer, like a real projection output.
    qkv = torch.randn(num_tokens, 3, heads, head_dim, generator=g).to(src_dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    cache = torch.randn(num_blocks, 2, block_size, heads, head_dim, generator=g).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    pad = torch.rand(num_tokens, generator=g) < 0.2
    slots[pad] = -1
    slots = slots.to(torch.int32 if seed % 2 else torch.int64)
    return [t.to(device) for t in (k, v, cache, slots)]


_CASES = [
    # (tokens, kv heads, head_dim, block_size, blocks, src dtype, cache dtype)
    (1, 1, 16, 4, 3, torch.float32, torch.float32),
    (37, 2, 80, 16, 8, torch.float32, torch.float32),    # non-power-of-2 head_dim
    (64, 4, 64, 8, 16, torch.bfloat16, torch.bfloat16),
    (20, 2, 32, 16, 4, torch.float16, torch.float16),
]


def _check_kv_write(device: str) -> None:
    from tokenbudget.kernels.kv_write import write_kv_triton

    for seed, case in enumerate(_CASES):
        k, v, cache, slots = _case(seed, device, *case)
        want = cache.clone()
        write_kv_reference(k, v, want, slots)
        got = cache.clone()
        write_kv_triton(k, v, got, slots)
        assert torch.equal(got, want), f"mismatch in case {case}"


def test_reference_matches_naive_loop():
    k, v, cache, slots = _case(3, "cpu", 25, 2, 8, 4, 10, torch.float32, torch.float32)
    want = cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // 4, 0, s % 4] = k[t]
            want[s // 4, 1, s % 4] = v[t]
    got = cache.clone()
    write_kv_reference(k, v, got, slots)
    assert torch.equal(got, want)
    got2 = cache.clone()
    write_kv(k, v, got2, slots)  # CPU dispatch == reference
    assert torch.equal(got2, want)


def test_reference_rejects_bad_shapes():
    k, v, cache, slots = _case(0, "cpu", 4, 1, 8, 4, 2, torch.float32, torch.float32)
    before = cache.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_reference(k, v, cache, slots[:3])
    with pytest.raises(ValueError, match="kv_cache"):
        write_kv_reference(k, v, cache[:, 0], slots)
    with pytest.raises(ValueError, match="dtype"):
        write_kv_reference(k, v, cache.half(), slots)
    assert torch.equal(cache, before)


@needs_triton
def test_triton_kv_write_interpreter_matches_reference():
    _run_interpreted("_check_kv_write", "cpu")


@pytest.mark.cuda
@needs_triton
@needs_cuda
def test_triton_kv_write_cuda_matches_reference():
    _check_kv_write("cuda")
