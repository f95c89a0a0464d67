"""Tool calling on ``/v1/chat/completions`` through the ``openai`` client.

The flow end to end against a real ``tokenbudget serve`` process on the default model (which
does not call tools by itself, so the calls are forced: ``tool_choice: "required"`` and a named
function, by the grammar engine, with the CLI's n-gram speculation on): the calls match their
schemas, streamed deltas add up to the non-streamed message, speculation changes nothing, and the
assistant message with its ``tool_calls`` plus ``tool`` answers go back for the next turn.
``"auto"`` with ``--tool-call-parser llama3_json``: the call is read from the model's own text
(steered into that format with ``response_format``). Bad tool fields are 400s naming them.

In process, on a tiny model: the chat template receives ``tools`` and the messages' tool fields
exactly as transformers' ``apply_chat_template`` passes them (its rendering is the reference),
and ``"auto"`` without ``--enable-auto-tool-choice`` is vLLM's 400.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai", reason="needs the [test] extra (openai)")
jsonschema = pytest.importorskip("jsonschema", reason="needs the [test] extra (jsonschema)")
transformers = pytest.importorskip("transformers", reason="needs the [test] extra (transformers)")

from engine_fixtures import default_model_path_or_skip  # noqa: E402
from serve_fixtures import KEY, MODEL, free_port, running_server  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def served():
    """``tokenbudget serve`` (the CLI, its default n-gram speculation) on the default model."""
    model = default_model_path_or_skip()
    for _ in range(3):  # a free port may be taken before the server binds it: another one then
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "tokenbudget", "serve", model, "--port", str(port),
                                 "--api-key", KEY, "--served-model-name", MODEL, "--num-threads", "1",
                                 "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
                                 "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        if proc.poll() is None:
            break
    else:
        pytest.fail(f"tokenbudget serve did not start: {proc.stderr.read()[-2000:]}")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
    proc.terminate()
    proc.wait(timeout=60)


def _create(client, stream=False, **kwargs):
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.model_dump(include={"content", "tool_calls"}), choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "type": tc.type, "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += tc.function.name or ""
            call["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)] or None}, finish


def _calls(message) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_streamed_or_not_match_their_schemas(served, tool_choice):
    message, finish = _create(served, tool_choice=tool_choice)
    calls = _calls(message)
    assert calls and message["content"] is None
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
        assert all(c["id"] and c["type"] == "function" for c in message["tool_calls"])
    if tool_choice == "required":
        assert finish == "tool_calls"
    else:
        assert finish == "stop" and [name for name, _ in calls] == ["get_weather"]
    streamed, streamed_finish = _create(served, stream=True, tool_choice=tool_choice)
    assert _calls(streamed) == calls and streamed["content"] is None and streamed_finish == finish
    plain, _ = _create(served, tool_choice=tool_choice, extra_body={"speculative": {"num_speculative_tokens": 0}})
    assert _calls(plain) == calls  # the grammar is exact under speculation


def test_tool_calling_flow_round_trips_calls_and_answers(served):
    """The openai client's flow: ask, get calls, append the assistant message as returned and a
    ``tool`` message per call, ask again."""
    first = served.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=80).choices[0]
    messages = [*ASK, first.message]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}
                 for call in first.message.tool_calls]
    second = served.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=8)
    choice = second.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > served.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens


LLAMA3_CALL = {"type": "json_schema", "json_schema": {"name": "call", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER},
    "required": ["name", "parameters"], "additionalProperties": False}}}


def test_auto_reads_the_calls_the_model_writes(served):
    """``--tool-call-parser llama3_json``: the model's output (held to Llama 3's call format by
    ``response_format``, since this model does not write calls of its own) is read as a call."""
    message, finish = _create(served, tool_choice="auto", response_format=LLAMA3_CALL)
    calls = _calls(message)
    assert finish == "tool_calls" and message["content"] is None and [n for n, _ in calls] == ["get_weather"]
    jsonschema.validate(calls[0][1], WEATHER)
    streamed, streamed_finish = _create(served, stream=True, tool_choice="auto", response_format=LLAMA3_CALL)
    assert _calls(streamed) == calls and streamed_finish == "tool_calls"
    text, _ = _create(served, tool_choice="auto", max_tokens=6)  # plain text stays text
    assert text["tool_calls"] is None and text["content"]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]}, "messages"),
])
def test_bad_tool_fields_are_400s_naming_them(served, kwargs, param):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **kwargs}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as info:
        served.chat.completions.create(**body)
    assert info.value.body["param"] == param


# A template that writes every tool field it is given (ids included), to compare with transformers.
TEMPLATE = (
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<call id={{ c.id }}>{{ c.function.name }}:{{ c.function.arguments | tojson }}"
    "</call>{% endfor %}"
    "{%- if m.tool_call_id %}<for id={{ m.tool_call_id }}/>{% endif %}</{{ m.role }}>\n{% endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tokenbudget import AsyncLLM
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=1, hidden=32)
    config_file = Path(path) / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": TEMPLATE}))
    return path, AsyncLLM(path, num_threads=1, kv_cache_memory_bytes=4 << 20, max_model_len=512)


SHORT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # the tiny model reads bytes: 512 at most


def test_the_template_gets_tools_and_tool_messages_as_transformers_passes_them(tiny, monkeypatch):
    path, llm = tiny
    rendered, chat_prompt = [], llm.tokenizer.chat_prompt

    def spy(*args, **kwargs):
        prompt = chat_prompt(*args, **kwargs)
        rendered.append(prompt["prompt"])
        return prompt
    monkeypatch.setattr(llm.tokenizer, "chat_prompt", spy)
    ask = {"role": "user", "content": "Weather?"}
    call = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    answer = {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}
    with running_server(llm) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        client.chat.completions.create(model=MODEL, tools=SHORT_TOOLS, tool_choice="none", max_tokens=1, messages=[
            ask, {"role": "assistant", "content": None, "tool_calls": [call]}, answer])
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):  # "auto": the default
            client.chat.completions.create(model=MODEL, messages=[ask], tools=SHORT_TOOLS, max_tokens=1)
    # what a transformers user passes: the arguments as an object (its docs), the content ""
    as_transformers = [ask, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, answer]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(path) / "tokenizer.json"), bos_token="<s>",
                                              eos_token="</s>")
    expected = hf.apply_chat_template(as_transformers, chat_template=TEMPLATE, tools=SHORT_TOOLS, tokenize=False,
                                      add_generation_prompt=True)
    assert rendered == [expected]
    assert "<call id=call-1>get_weather:" in expected and "<for id=call-1/>" in expected and "<tools>" in expected
