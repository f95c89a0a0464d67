"""The NEON variant of the C kernels (kernels/cpu/gemm_neon.h), run on any machine: cross-compiled
with ``aarch64-linux-gnu-gcc -march=armv8.2-a+dotprod`` into a standalone driver
(tests/native_driver.c) and run under ``qemu-aarch64`` (natively with ``cc`` on an aarch64 host).

Checked: the q4/q8 GEMMs and one decoder layer against float64 numpy references, rows bitwise the
same alone as inside the batch (and the layer's rows one call each), at 1 and 2 threads, and the
bits equal to the native ``scalar`` variant's (the float rule of quant_gemm.c is the same on every
variant). Small shapes: emulation is slow. ``.ci/run`` installs the cross compiler and qemu, so in
CI (``CI=true``) their absence fails instead of skipping.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenbudget.kernels.cpu import native
from tokenbudget.kernels.cpu import quant_gemm as cg
from tokenbudget.kernels.cpu.decoder_forward import TbForward, TbLayer, TbLinear, tb_forward

from native_variants import in_ci, q4_weight, q8_weight, use_variant

ROOT = Path(__file__).resolve().parents[1]
CROSS_CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> list[str]:
    """The command that runs the NEON driver here (built once)."""
    native_arm = native.machine() == "aarch64"
    cc = native._compiler() if native_arm else shutil.which(CROSS_CC)
    runner = [] if native_arm else [shutil.which(QEMU), "-L", SYSROOT]
    if cc is None or None in runner:
        why = f"{CROSS_CC} or {QEMU} not installed (apt-get install gcc-aarch64-linux-gnu qemu-user)"
        if in_ci():
            pytest.fail(why + ": .ci/run installs them")
        pytest.skip(why)
    exe = tmp_path_factory.mktemp("neon") / "native_driver"
    src = ROOT / "kernels" / "cpu"
    proc = subprocess.run([cc, *native.COMMON_CFLAGS[:2], *native.BY_NAME["neon"].cflags, "-fopenmp",
                           "-I", str(src), "-o", str(exe), str(ROOT / "tests" / "native_driver.c"),
                           str(src / "quant_gemm.c"), str(src / "eagle3_head.c"), "-lm"],  # the head: built, not run
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [*runner, str(exe)]


def _run(driver, mode: str, blobs: list, tmp_path: Path, count: int) -> np.ndarray:
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(src, "wb") as f:
        for b in blobs:
            data = np.ascontiguousarray(b).tobytes()
            f.write(np.int64(len(data)).tobytes() + data)
    proc = subprocess.run([*driver, mode, str(src), str(dst)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("neon"), proc.stdout + proc.stderr
    return np.fromfile(dst, dtype=np.float32).reshape(2, count)



def _linear_blobs(weight) -> list:
    fmt = 4 if isinstance(weight, cg.Q4Weight) else 8
    s = weight.s.numpy() if fmt == 8 else np.zeros(0, np.float32)
    return [np.array([fmt], np.int64), weight.packed.numpy(), s, np.zeros(0, np.float32)]


def _x_hat(x: np.ndarray) -> np.ndarray:
    """The kernels' int8 activations per group of 32, back in float64 (round half to even)."""
    g = x.reshape(x.shape[0], -1, 32).astype(np.float64)
    amax = np.abs(x.reshape(g.shape)).max(-1, keepdims=True).astype(np.float32)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.round(x.reshape(g.shape) * inv)
    return (q * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_neon_gemm_matches_numpy_and_rows_are_invariant(driver, tmp_path, fmt, threads, monkeypatch):
    g = torch.Generator().manual_seed(11)
    n, k, m = 37, 96, 6
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    x[2] = 0.0
    weight = q4_weight(w) if fmt == "q4" else q8_weight(w)
    lin = _linear_blobs(weight)
    got = _run(driver, "gemm", [np.array([int(fmt[1]), m, k, n, threads], np.int64), x.numpy(), lin[1], lin[2]],
               tmp_path, m * n)
    want = _x_hat(x.numpy()) @ weight.dequantize().double().numpy().T
    assert np.abs(got[0].reshape(m, n) - want).max() <= 1e-5 * np.abs(want).max()
    assert np.array_equal(got[0], got[1])  # each row alone == inside the batch
    use_variant("scalar", monkeypatch)
    native_bits = (cg.gemm_q4 if fmt == "q4" else cg.gemm_q8)(x, weight).numpy().ravel()
    assert np.array_equal(got[0], native_bits)


# One small layer: H 64, 4 query heads and 2 KV heads of 16, intermediate 96; one request of 20
# tokens from position 0 in blocks of 8.
T, H, HQ, HK, D, I, BS, NBLK = 20, 64, 4, 2, 16, 96, 8, 4
MAX_POS, EPS = 64, 1e-5


def _rope_tables() -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (10000.0 ** (np.arange(0, D, 2) / D))
    ang = np.arange(MAX_POS)[:, None] * np.concatenate([inv, inv])[None]
    sign = np.concatenate([-np.ones(D // 2), np.ones(D // 2)])
    return np.cos(ang).astype(np.float32), (np.sin(ang) * sign).astype(np.float32)


def _reference_layer(x, norms, weights, cos, sin) -> np.ndarray:
    """One Llama decoder layer in float64 (the weights as the kernels hold them, activations unrounded)."""
    def rms(v, w):
        return w * v / np.sqrt((v * v).mean(-1, keepdims=True) + EPS)

    def rope(v):  # [T, heads, D]
        return v * cos[:T, None] + np.roll(v, -D // 2, axis=-1) * sin[:T, None]

    x = x.astype(np.float64)
    wqkv, wo, wgu, wdn = (w.dequantize().double().numpy() for w in weights)
    qkv = rms(x, norms[0]) @ wqkv.T
    q = rope(qkv[:, :HQ * D].reshape(T, HQ, D))
    k = rope(qkv[:, HQ * D:(HQ + HK) * D].reshape(T, HK, D))
    v = qkv[:, (HQ + HK) * D:].reshape(T, HK, D)
    att = np.empty((T, HQ, D))
    for hh in range(HQ):
        kh, vh = k[:, hh // (HQ // HK)], v[:, hh // (HQ // HK)]
        s = q[:, hh] @ kh.T / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        att[:, hh] = (p / p.sum(-1, keepdims=True)) @ vh
    x = x + att.reshape(T, -1) @ wo.T
    gu = rms(x, norms[1]) @ wgu.T
    g, u = gu[:, :I], gu[:, I:]
    return x + (g / (1 + np.exp(-g)) * u) @ wdn.T


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_neon_decoder_layer_matches_numpy_and_rows_are_invariant(driver, tmp_path, fmt, monkeypatch):
    g = torch.Generator().manual_seed(12)
    quant = q4_weight if fmt == "q4" else q8_weight
    shapes = [((HQ + 2 * HK) * D, H), (H, HQ * D), (2 * I, H), (H, I)]
    weights = [quant(torch.randn(*s, generator=g) * 0.1) for s in shapes]
    norms = [(1 + 0.1 * torch.randn(H, generator=g)).numpy() for _ in range(2)]
    x = torch.randn(T, H, generator=g).numpy()
    cos, sin = _rope_tables()
    pos = np.arange(T, dtype=np.int64)
    ctx, req, table = (pos + 1).astype(np.int32), np.zeros(T, np.int32), np.arange(NBLK, dtype=np.int32)
    kv = np.zeros((NBLK, 2, BS, HK, D), np.float32)
    head = np.array([T, H, HQ, HK, D, I, BS, NBLK, 2], np.int64)
    blobs = [head, np.array([EPS, D ** -0.5], np.float32), x, pos, cos, sin, pos, ctx, req, table, *norms, kv]
    for w in weights:
        blobs += _linear_blobs(w)
    got = _run(driver, "forward", blobs, tmp_path, T * H)
    want = _reference_layer(x, norms, weights, cos, sin)
    assert np.abs(got[0].reshape(T, H) - want).max() <= 2e-2 * np.abs(want).max()
    assert np.array_equal(got[0], got[1])  # one call of 20 rows == 20 calls of one row

    use_variant("scalar", monkeypatch)
    keep = [torch.from_numpy(np.ascontiguousarray(a)) for a in (x, pos, cos, sin, ctx, req, table, *norms, kv)]
    xs, pos_t, cos_t, sin_t, ctx_t, req_t, table_t, n0, n1, kv_t = keep
    lins = [TbLinear(int(fmt[0]), *[b.ctypes.data if b.size else 0 for b in rest])
            for fmt, *rest in map(_linear_blobs, weights)]
    layer = (TbLayer * 1)(TbLayer(attn_in_norm=n0.data_ptr(), mlp_in_norm=n1.data_ptr(), cos=cos_t.data_ptr(),
                                  sin=sin_t.data_ptr(), kv=kv_t.data_ptr(), qkv=lins[0], o=lins[1], gate_up=lins[2],
                                  down=lins[3]))
    args = TbForward(num_tokens=T, hidden=H, num_heads=HQ, num_kv_heads=HK, head_dim=D, intermediate=I, num_layers=1,
                     block_size=BS, max_blocks=NBLK, num_threads=2, rotary_dim=D, eps=EPS, scale=D ** -0.5,
                     residual_mult=1.0, layers=layer, x=xs.data_ptr(), positions=pos_t.data_ptr(),
                     slots=pos_t.data_ptr(), row_ctx=ctx_t.data_ptr(), row_req=req_t.data_ptr(),
                     block_tables=table_t.data_ptr())
    tb_forward(args)
    assert np.array_equal(got[0], xs.numpy().ravel())
