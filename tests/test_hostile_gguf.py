"""The GGUF parser on hostile bytes: every malformed file is a ValueError naming the file, the
field and the byte offset; never struct.error, UnicodeDecodeError, RecursionError, IndexError,
OverflowError, MemoryError or an allocation sized by a count in the file (issue 39, issue 47).

Cases are crafted byte by byte (tests/gguf_craft.py) and, where the issue tried them, on the
default model; a Hypothesis test mutates a small valid file at random under an address-space
limit (in a child process), so a giant allocation fails it.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
from gguf_craft import Q, T, encode, kv, string, tensor_info, tiny_model, u32, u64, value

from tokenbudget.engine.loader.gguf_file import parse_gguf, read_gguf

NAME = "hostile.gguf"


def refused(data: bytes, *fields: str) -> str:
    """Parse ``data``; it must raise ValueError naming the file and each of ``fields``."""
    with pytest.raises(ValueError) as exc:
        parse_gguf(data, NAME)
    message = str(exc.value)
    assert type(exc.value) is ValueError and message.startswith(f"{NAME}: "), message
    for f in fields:
        assert f in message, message
    assert "\n" not in message
    return message


def with_kv(raw: bytes) -> bytes:
    spec = tiny_model()
    spec.raw_kvs.append(raw)
    return encode(spec)


def test_the_tiny_model_parses():
    g = parse_gguf(encode(tiny_model(qtype=Q.Q8_0)), NAME)
    assert g.metadata["llama.block_count"] == 2 and len(g.tensors) == 20
    assert g.tensors[0].name == "token_embd.weight" and g.tensors[0].data.shape == (40, 34)


# ---------------------------------------------------------------- truncation, counts


def test_truncated_anywhere_in_the_headers_and_the_data():
    data = encode(tiny_model(qtype=Q.Q8_0))
    for n in [*range(0, 2600), *range(2600, len(data), 97), len(data) - 1]:
        refused(data[:n])


def test_default_model_truncated_at_1kb_and_counts_of_2_63(tmp_path):
    from engine_fixtures import default_model_path_or_skip
    with open(default_model_path_or_skip(), "rb") as f:
        head = f.read(4 << 20)
    refused(head[:1024], "header", "byte 8")
    refused(head, "runs past the end of the file")  # metadata whole, tensor data cut off
    refused(head[:8] + u64(2**63) + head[16:], "9223372036854775808 tensors")
    refused(head[:16] + u64(2**63) + head[24:], "9223372036854775808 key/value pairs")
    path = tmp_path / "cut.gguf"
    path.write_bytes(head[:1024])
    with pytest.raises(ValueError, match=f"^{path}: header"):
        read_gguf(path)


def test_empty_and_tiny_files_and_other_versions(tmp_path):
    for data in (b"", b"GGUF", b"GGUF" + bytes(10)):
        path = tmp_path / "small.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match="not a GGUF file"):
            read_gguf(path)
    good = encode(tiny_model())
    refused(good[:4] + u32(1) + good[8:], "version 1")
    refused(good[:4] + struct.pack(">I", 3) + good[8:], "big-endian")


# ---------------------------------------------------------------- metadata values


@pytest.mark.parametrize("elem,size", [(T.STRING, 8), (T.UINT32, 4), (T.UINT8, 1), (T.FLOAT64, 8)])
def test_array_of_2_62_entries(elem, size):
    message = refused(with_kv(kv("x.tokens", T.ARRAY, u32(elem) + u64(2**62))), "'x.tokens'", "4611686018427387904")
    assert "byte" in message


def test_arrays_nested_200k_deep():
    nested = (u32(T.ARRAY) + u64(1)) * 200_000 + u32(T.UINT8) + u64(0)
    refused(with_kv(kv("deep", T.ARRAY, nested)), "'deep'", "arrays of arrays")


@pytest.mark.parametrize("payload,kind", [(u32(0), T.UINT32), (u32(48), T.UINT32), (u64(2**40), T.UINT64),
                                          (string("32"), T.STRING), (struct.pack("<f", 32.0), T.FLOAT32),
                                          (struct.pack("<?", True), T.BOOL), (struct.pack("<i", -32), T.INT32)])
def test_alignment_zero_odd_huge_or_not_an_integer(payload, kind):
    refused(with_kv(kv("general.alignment", kind, payload)), "general.alignment")


def test_alignment_64_is_honoured():
    spec = tiny_model()
    spec.alignment = 64
    spec.meta["general.alignment"] = (T.UINT32, 64)
    assert len(parse_gguf(encode(spec)).tensors) == 20


@pytest.mark.parametrize("raw,fields", [
    (kv("k", 13, u32(0)), ("'k'", "unknown value type 13")),
    (kv("k", T.ARRAY, u32(13) + u64(1)), ("'k'", "unknown array element type 13")),
    (kv(b"k\xff\xfe", T.UINT32, u32(0)), (f"key/value pair {len(tiny_model().meta)}", "not valid UTF-8")),
    (kv("k", T.STRING, string(b"\xc3\x28")), ("'k'", "not valid UTF-8")),
    (kv("k", T.ARRAY, u32(T.STRING) + u64(2) + string("ok") + string(b"\xe2\x82")), ("'k'", "string 1", "UTF-8")),
    (kv("general.architecture", T.STRING, string("llama")), ("'general.architecture'", "appears twice")),
    (kv("k", T.STRING, u64(2**40)), ("'k'", "1099511627776 bytes")),
    (u64(2**63) + b"key", (f"key/value pair {len(tiny_model().meta)}", "9223372036854775808 bytes")),
])
def test_malformed_values(raw, fields):
    message = refused(with_kv(raw), *fields)
    assert "(byte " in message


def test_a_key_with_a_newline_stays_on_one_line():
    refused(with_kv(kv("a\nb", 13, b"")), "'a\\nb'")


# ---------------------------------------------------------------- tensor infos and data


def tiny_with_infos(*infos: bytes, data: int = 4096) -> bytes:
    """The tiny model's metadata, the given tensor infos and ``data`` bytes of tensor data."""
    meta = tiny_model().meta
    head = (b"GGUF" + u32(3) + u64(len(infos)) + u64(len(meta))
            + b"".join(kv(k, t, value(t, v)) for k, (t, v) in meta.items()) + b"".join(infos))
    return head + bytes(-len(head) % 32) + bytes(data)


@pytest.mark.parametrize("info,fields", [
    (tensor_info("q", (), Q.Q4_1, 0), ("'q'", "0 dimensions")),
    (tensor_info("f", (), Q.F32, 0), ("'f'", "0 dimensions")),
    (tensor_info("f", (1, 1, 1, 1, 1), Q.F32, 0), ("'f'", "5 dimensions")),
    (tensor_info("f", (0, 4), Q.F32, 0), ("'f'", "at least 1")),
    (tensor_info("f", (2**63, 1), Q.F32, 0), ("'f'", "below 2**63")),
    (tensor_info("f", (2**32, 2**32), Q.F32, 0), ("'f'", "more than an int64 holds")),
    (tensor_info("f", (2**31, 2**31), Q.F32, 0), ("'f'", "runs past the end of the file")),
    (tensor_info("f", (4,), 99, 0), ("'f'", "unknown tensor type 99")),
    (tensor_info("q", (33,), Q.Q8_0, 0), ("'q'", "32-value blocks")),
    (tensor_info("f", (4,), Q.F32, 2**64 - 32), ("'f'", "past the end of the file")),
    (tensor_info("f", (4,), Q.F32, 4096), ("'f'", "past the end of the file")),
    (tensor_info("f", (4,), Q.F32, 8), ("'f'", "not a multiple of general.alignment")),
    (tensor_info(b"\xff", (4,), Q.F32, 0), ("tensor info 0", "UTF-8")),
])
def test_malformed_tensor_infos(info, fields):
    refused(tiny_with_infos(info), *fields)


def test_duplicate_and_overlapping_tensors():
    refused(tiny_with_infos(tensor_info("a", (8,), Q.F32, 0), tensor_info("a", (8,), Q.F32, 32)),
            "'a'", "appears twice")
    refused(tiny_with_infos(tensor_info("a", (64,), Q.F32, 0), tensor_info("b", (8,), Q.F32, 32)),
            "'b'", "overlaps tensor 'a'")
    ok = parse_gguf(tiny_with_infos(tensor_info("a", (8,), Q.F32, 32), tensor_info("b", (8,), Q.F32, 0)))
    assert [t.name for t in ok.tensors] == ["a", "b"]


def test_strings_cost_their_bytes_first():
    """A string array whose every entry claims 2**40 bytes fails at the first, before decoding."""
    refused(with_kv(kv("s", T.ARRAY, u32(T.STRING) + u64(3) + string("a") + u64(2**40))), "'s'",
            "string 1 of the array (1099511627776 bytes) runs past the end of the file")
    assert value(T.ARRAY, (T.STRING, ["x"])) == u32(T.STRING) + u64(1) + string("x")


# ---------------------------------------------------------------- random mutations, memory-bounded

_CHILD = r"""
import resource, sys
sys.path.insert(0, {tests!r})
from hypothesis import HealthCheck, given, settings, strategies as st
from gguf_craft import Q, encode, tiny_model
from tokenbudget.engine.loader.gguf_file import parse_gguf
from tokenbudget.engine.loader.model_checks import check_gguf_model

vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))  # +1 GiB
SEED = encode(tiny_model(qtype=Q.Q8_0))
BIG = [0, 1, 2, 7, 8, 9, 13, 31, 33, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
edit = st.one_of(
    st.tuples(st.just("u64"), st.integers(0, len(SEED) - 8), st.sampled_from(BIG) | st.integers(0, 2**64 - 1)),
    st.tuples(st.just("u32"), st.integers(0, len(SEED) - 4), st.sampled_from(BIG[:11]) | st.integers(0, 2**32 - 1)),
    st.tuples(st.just("byte"), st.integers(0, len(SEED) - 1), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(0, len(SEED)), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, len(SEED)), st.binary(min_size=1, max_size=16)),
)

@settings(max_examples={examples}, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(st.lists(edit, min_size=1, max_size=4))
def parse_mutated(edits):
    data = bytearray(SEED)
    for kind, at, v in edits:
        if kind == "u64":
            data[at:at + 8] = v.to_bytes(8, "little")
        elif kind == "u32":
            data[at:at + 4] = v.to_bytes(4, "little")
        elif kind == "byte":
            data[at % max(len(data), 1):at % max(len(data), 1) + 1] = bytes([v])
        elif kind == "cut":
            del data[at:]
        else:
            data[at:at] = v
    try:
        check_gguf_model(parse_gguf(bytes(data), "fuzz.gguf"))
    except ValueError as exc:
        assert type(exc) is ValueError and str(exc).startswith("fuzz.gguf: "), repr(exc)

parse_mutated()
print("ok")
"""


def test_random_mutations_give_only_value_errors_within_1_gib():
    tests = os.path.dirname(os.path.abspath(__file__))
    code = _CHILD.format(tests=tests, examples=1500)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-3000:] + res.stderr[-6000:]
