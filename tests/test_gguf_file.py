"""Our one-pass GGUF reader against the ``gguf`` package's reader, on the default model file and
on small files written by ``gguf.GGUFWriter`` (every metadata value type, float and quantized
tensors)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from tokenbudget.engine.loader.gguf_file import read_gguf


def _assert_same(path) -> None:
    ref = GGUFReader(path)
    got = read_gguf(path)
    assert got.metadata == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert len(got.tensors) == len(ref.tensors)
    for a, b in zip(ref.tensors, got.tensors):
        assert (b.name, b.tensor_type, b.shape) == (a.name, a.tensor_type, tuple(int(x) for x in a.shape))
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape
        assert np.array_equal(a.data, b.data)


def test_default_model_file_reads_the_same():
    from engine_fixtures import default_model_path_or_skip
    _assert_same(default_model_path_or_skip())


def test_written_file_reads_the_same(tmp_path):
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("a.u32", 7)
    w.add_int32("a.i32", -3)
    w.add_float32("a.f32", 0.5)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo ▁ world")
    w.add_uint64("a.u64", 2**40)
    w.add_array("a.ints", [1, 2, 3])
    w.add_array("a.strs", ["x", "", "ü"])
    w.add_array("a.floats", [0.25, -1.5])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("q8", rng.integers(0, 255, (4, 34 * 2), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same(str(path))


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(p))
