"""``--tool-call-parser`` (``engine/serve/tool_parsers.py``) on crafted model outputs, in the
formats vLLM's hermes, llama3_json and mistral parsers read: the calls and content extracted, a
malformed call left as content, and the streamed deltas (content as it comes, calls at the end;
required arrays item by item, named arguments as written) adding up to exactly the non-streamed
message however the text is cut into deltas (Hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.engine.serve.tool_calls import ToolRequest
from tokenbudget.engine.serve.tool_parsers import FunctionCall, get_parser

WEATHER = {"city": "Paris", "unit": "°C", "days": [1, 2]}
ARGS = json.dumps(WEATHER, ensure_ascii=False)

# (parser, model output, content, calls)
CASES = [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
     + "}\n</tool_call>", "Let me check.", [FunctionCall("get_weather", ARGS)]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
     '{"x": 1}}\n</tool_call>', None, [FunctionCall("a", "{}"), FunctionCall("b", '{"x": 1}')]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"q": "unclosed"}}', None,
     [FunctionCall("a", '{"q": "unclosed"}')]),
    ("hermes", 'Text only, a < b and <tool', 'Text only, a < b and <tool', []),
    ("hermes", 'Broken <tool_call>{"name": "a", "arguments": {</tool_call>', 'Broken <tool_call>{"name": "a", '
     '"arguments": {</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}", None,
     [FunctionCall("get_weather", ARGS)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "y"}}', None,
     [FunctionCall("a", "{}"), FunctionCall("b", '{"x": "y"}')]),
    ("llama3_json", '  {"name": "a", "parameters": {}} and then text',
     '  {"name": "a", "parameters": {}} and then text', []),
    ("llama3_json", 'The answer is {"name": "a", "parameters": {}}',
     'The answer is {"name": "a", "parameters": {}}', []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]", "Sure.",
     [FunctionCall("get_weather", ARGS)]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris", "unit": "°C", "days": [1, 2]}[TOOL_CALLS]b{}', None,
     [FunctionCall("get_weather", ARGS), FunctionCall("b", "{}")]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C", "days": [1, 2]}', None,
     [FunctionCall("get_weather", ARGS)]),
    ("mistral", "[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_extract(name, text, content, calls):
    found = get_parser(name).extract(text)
    assert found.content == content and found.calls == calls


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def _streamed(tools: ToolRequest, pieces: list[str], finish_reason: str) -> tuple[dict, str]:
    """The message the openai client assembles from the streamed deltas."""
    stream, deltas = tools.stream(), []
    for piece in pieces:
        deltas += stream.feed(piece)
    more, finish = stream.finish(finish_reason)
    deltas += more
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
            call["name"] += tc.get("function", {}).get("name") or ""
            call["arguments"] += tc["function"].get("arguments") or ""
            assert "id" not in tc or tc["id"] == call["id"]
    assert sorted(calls) == list(range(len(calls)))
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]
    return message, finish


def _without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{**c, "id": None} for c in message.get("tool_calls", [])]}


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_auto_streaming_adds_up_to_the_message(case, cuts):
    name, text, _, calls = case
    tools = ToolRequest.from_body([{"type": "function", "function": {"name": "get_weather"}}], "auto", None,
                                  get_parser(name))
    message, finish = tools.message(text, "stop")
    assert finish == ("tool_calls" if calls else "stop")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == \
        [(c.name, c.arguments) for c in calls]
    streamed, streamed_finish = _streamed(tools, _split(text, cuts), "stop")
    assert _without_ids(streamed) == _without_ids(message) and streamed_finish == finish


def test_auto_streaming_sends_content_before_the_call_as_it_comes():
    stream = ToolRequest.from_body([{"type": "function", "function": {"name": "f"}}], "auto", None,
                                   get_parser("hermes")).stream()
    assert stream.feed("Let me ") == [{"content": "Let me "}]
    assert stream.feed("look <tool") == [{"content": "look "}]  # "<tool" may begin a call: held back
    assert stream.feed('_call>{"name": "f", "arguments": {}}</tool_call>') == []
    deltas, finish = stream.finish("stop")
    assert finish == "tool_calls" and deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_parallel_tool_calls_false_keeps_the_first_call():
    tools = ToolRequest.from_body([{"type": "function", "function": {"name": "a"}}], "auto", False,
                                  get_parser("hermes"))
    message, _ = tools.message(CASES[1][1], "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"]


def test_mistral_ids_are_nine_alphanumerics_and_keep_special_tokens():
    tools = ToolRequest.from_body([{"type": "function", "function": {"name": "b"}}], "auto", None,
                                  get_parser("mistral"))
    message, _ = tools.message("[TOOL_CALLS]b{}", "stop")
    call_id = message["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()
    assert tools.sampling_options(_limits()) == {"skip_special_tokens": False}


def _limits():
    from tokenbudget.engine.serve.limits import ServerLimits
    return ServerLimits()


REQUIRED_OUT = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": {}}],
                          ensure_ascii=False)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12), cut_at=st.integers(1, len(REQUIRED_OUT)))
def test_required_streams_each_item_once_complete(cuts, cut_at):
    """Forced "required" output (a JSON array): streamed calls = non-streamed calls, the whole
    output's and a truncated (``length``) output's complete items alike."""
    tools = ToolRequest.from_body(TOOLS, "required", None, None)
    for text, reason in ((REQUIRED_OUT, "stop"), (REQUIRED_OUT[:cut_at], "length")):
        message, finish = tools.message(text, reason)
        streamed, streamed_finish = _streamed(tools, _split(text, cuts), reason)
        assert _without_ids(streamed) == _without_ids(message) and streamed_finish == finish
    full, finish = tools.message(REQUIRED_OUT, "stop")
    assert finish == "tool_calls" and full["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in full["tool_calls"]] == \
        [("get_weather", WEATHER), ("get_time", {})]


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 100), max_size=8))
def test_named_streams_the_arguments_as_written(cuts):
    tools = ToolRequest.from_body(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, None)
    message, finish = tools.message(ARGS, "stop")
    assert finish == "stop" and message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ARGS}
    streamed, _ = _streamed(tools, _split(ARGS, cuts), "stop")
    assert _without_ids(streamed) == _without_ids(message)


def test_required_schema_is_vllms():
    tools = ToolRequest.from_body(TOOLS, "required", False, None)
    assert tools.schema() == {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": {"type": "object"}},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]}]}}
