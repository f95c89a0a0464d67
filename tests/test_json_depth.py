"""The body check before decoding grows linearly with the body, for every shape of hostile JSON
(issue 47: a regex that looked for the end of a string from every escaped quote took 20 s on
64 KB of ``"\\"\\"...``, holding the GIL, so the whole server froze).

A benchmark, not a timed test: each shape is decoded at 256 KiB and at 4 MiB, and the larger
may take at most 64 times as long (linear: 16 times; the quadratic scan: 256 times, and hours).
The timeout turns the old quadratic scan (minutes at 256 KiB) into a failure instead of a hang.
"""

from __future__ import annotations

import time

import pytest

from tokenbudget.engine.serve import protocol as proto
from tokenbudget.engine.serve.limits import LimitError, ServerLimits

SMALL, LARGE = 256 << 10, 4 << 20
LIMITS = ServerLimits(max_request_bytes=8 << 20)

SHAPES = {  # size -> a body of about that many bytes
    "escaped-quotes-unterminated": lambda n: b'{"prompt": "' + b'\\"' * (n // 2),
    "escaped-quotes-and-brackets-unterminated": lambda n: b'{"prompt": "' + b'\\"[' * (n // 3),
    "unterminated-string": lambda n: b'{"prompt": "' + b"a" * n,
    "backslash-runs": lambda n: b'{"prompt": "' + b"\\\\\\" * (n // 3),
    "quotes-and-brackets-in-a-string": lambda n: b'{"prompt": "' + b'\\"[{' * (n // 4) + b'"}',
    "deep-arrays": lambda n: b'{"prompt": ' + b"[" * n,
    "deep-objects": lambda n: b'{"prompt": ' + b'{"a":' * (n // 5),
    "long-number": lambda n: b'{"max_tokens": ' + b"1" * n + b', "prompt": "x"}',
    "many-fields-each-40-deep": lambda n: b"{" + b",".join([b'"stop": ' + b"[" * 40 + b"]" * 40] * (n // 90)) + b"}",
}


def decode_seconds(body: bytes, repeats: int) -> float:
    """The least CPU time of this thread over ``repeats`` decodes: other processes on a shared
    machine (a CI run beside benchmarks) stretch wall time, not this thread's CPU time."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        try:
            proto.decode(body, proto.CompletionRequest, LIMITS)
        except ValueError:
            pass
        best = min(best, time.thread_time() - start)
    return best


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_checking_a_body_grows_linearly_with_its_size(shape):
    make = SHAPES[shape]
    small, large = make(SMALL), make(LARGE)
    decode_seconds(small, 1)  # warm
    small_s, large_s = float("inf"), float("inf")
    for _ in range(3):  # interleaved: a slow moment of the machine hits both sizes alike
        small_s = min(small_s, decode_seconds(small, 3))
        large_s = min(large_s, decode_seconds(large, 1))
    ratio = large_s / max(small_s, 1e-6)
    # linear: 16x; quadratic (the regex scan this replaced): 256x; the margin absorbs cache effects
    assert ratio < 128, f"{shape}: 16x the bytes took {ratio:.0f}x the CPU time"


@pytest.mark.parametrize("depth", [33, 40, 64])
def test_a_field_may_nest_as_deep_as_max_json_depth(depth):
    """Once, anything past 32 levels was refused as past --max-json-depth=64."""
    part = b'{"type": "text", "text": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
    body = b'{"messages": [{"role": "user", "content": [' + part + b"]}]}"
    field_depth = depth + 4  # messages [ {  content [ {
    limits = ServerLimits(max_json_depth=field_depth)
    assert proto.decode(body, proto.ChatCompletionRequest, limits).messages[0].role == "user"
    with pytest.raises(LimitError, match="messages is nested more than --max-json-depth") as refused:
        proto.decode(body, proto.ChatCompletionRequest, ServerLimits(max_json_depth=field_depth - 1))
    assert refused.value.param == "messages"


def test_response_format_has_its_own_depth_limit_and_an_escaped_name_is_its_name():
    schema = b'{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + b'{"not": ' * 40 + b"{}" + b"}" * 40
    body = b'{"messages": [{"role": "user", "content": "hi"}], "response_form\\u0061t": ' + schema + b"}}}"
    with pytest.raises(LimitError, match="--max-schema-depth=32") as refused:
        proto.decode(body, proto.ChatCompletionRequest, ServerLimits())
    assert refused.value.param == "response_format"
    assert proto.decode(body, proto.ChatCompletionRequest, ServerLimits(max_schema_depth=50)).response_format
