"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, served as vLLM serves them.

``tool_choice`` (default ``"auto"`` when ``tools`` are given, else ``"none"``):

* ``"none"``: plain text (the tools still reach the chat template, as in vLLM);
* a named function (``{"type": "function", "function": {"name": ...}}``): the output is forced by
  the grammar engine to the function's ``parameters`` schema and becomes that call's arguments;
* ``"required"``: forced to vLLM's schema, a JSON array (at least one item; at most one with
  ``parallel_tool_calls: false``) of ``{"name": <one of the tools>, "parameters": <its
  schema>}``; each item becomes a call;
* ``"auto"``: the model writes calls in its own format, read by the server's
  ``--tool-call-parser`` (``tool_parsers``); without ``--enable-auto-tool-choice`` it is a 400, as
  in vLLM. ``parallel_tool_calls: false`` keeps the first call.

Forced choices are structured outputs: exact under speculation like every grammar
(docs/structured_output.md). The schema built from the tools is bounded as ``response_format``
is (``--max-schema-bytes``, ``--max-schema-depth``) and cannot be combined with it.

Answers: the message's ``tool_calls`` (``id``, ``type: "function"``, ``function.name``,
``function.arguments`` as JSON text) and ``content`` (None when the model wrote only calls);
``finish_reason`` is ``"tool_calls"`` when ``"auto"`` found calls or ``"required"`` ended at the
grammar's end, else the output's own (a named choice keeps ``"stop"``, as OpenAI and vLLM).
Streamed (``ToolStream``): a named call's arguments as the model writes them (the first delta
carries the id and name); a required call once its array item is complete; ``"auto"`` calls
once the output ends (``tool_parsers.AutoToolStream``). The deltas of a choice always add up to
its non-streamed message.

Messages: an assistant message's ``tool_calls`` reach the template with their ``arguments``
parsed into an object (what transformers' templates expect, as vLLM does), and a ``tool``
message keeps its ``tool_call_id``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tokenbudget.engine.serve.limits import LimitError, ServerLimits, flag
from tokenbudget.engine.serve.tool_parsers import AutoToolStream, FunctionCall, NotACall, ToolParser, parse_call

_NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` / message field; ``param`` names it (400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_tools(tools: Any) -> dict[str, dict]:
    """``tools`` as OpenAI defines them; ``{name: function}``. ``ToolError`` naming ``tools``."""
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions.setdefault(fn["name"], fn)
    return functions


class ToolRequest:
    """What one chat body asks of tools (``mode``: none, auto, required or named)."""

    def __init__(self, mode: str, functions: dict[str, dict], name: str | None = None,
                 parser: ToolParser | None = None, parallel: bool = True) -> None:
        self.mode, self.functions, self.name, self.parser, self.parallel = mode, functions, name, parser, parallel
        self.new_call_id: Callable[[], str] = parser.new_call_id if parser is not None else ToolParser.new_call_id

    @classmethod
    def from_body(cls, tools: Any, tool_choice: Any, parallel_tool_calls: bool | None,
                  parser: ToolParser | None) -> ToolRequest:
        """vLLM's checks (``ChatCompletionRequest.check_tool_usage``) as ``ToolError``s."""
        functions = check_tools(tools) if tools is not None else {}
        choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
        parallel = parallel_tool_calls is not False
        if choice == "none":
            return cls("none", functions, parser=parser)
        if tools is None:
            raise ToolError("tool_choice needs tools", "tool_choice")
        if choice == "required":
            return cls("required" if functions else "none", functions, parser=parser, parallel=parallel)
        if choice == "auto":
            if parser is None:
                raise ToolError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                "to be set", "tool_choice")
            return cls("auto", functions, parser=parser, parallel=parallel)
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
            raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', "tool_choice")
        if name not in functions:
            raise ToolError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return cls("named", functions, name=name, parser=parser)

    # ---- the request's sampling
    def schema(self) -> dict | None:
        """The JSON schema the output is forced to (required and named), else None."""
        if self.mode == "named":
            return self.functions[self.name].get("parameters") or _NO_PARAMETERS
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        items = []
        for name, fn in self.functions.items():
            params = dict(fn.get("parameters") or _NO_PARAMETERS)
            for key, value in params.pop("$defs", {}).items():
                if defs.setdefault(key, value) != value:
                    raise ToolError(f"tools define $defs {key!r} twice, differently", "tools")
            items.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                          "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def sampling_options(self, limits: ServerLimits) -> dict[str, Any]:
        """``SamplingParams`` fields this choice sets: the grammar of a forced choice (bounded
        like ``response_format``); special tokens kept for a parser whose marker is one."""
        schema = self.schema()
        if schema is not None:
            from tokenbudget.api.structured_params import StructuredOutputsParams

            size = len(json.dumps(schema))
            if size > limits.max_schema_bytes:
                raise LimitError(f"the schema of tool_choice {self.mode!r} is {size} bytes, more than "
                                 f"{flag('max_schema_bytes')}={limits.max_schema_bytes}", "tools")
            if _depth(schema) > limits.max_schema_depth:
                raise LimitError(f"the schema of tool_choice {self.mode!r} is nested deeper than "
                                 f"{flag('max_schema_depth')}={limits.max_schema_depth}", "tools")
            try:
                return {"structured_outputs": StructuredOutputsParams(json=schema)}
            except ValueError as exc:
                raise ToolError(f"tools: {exc}", "tools") from None
        if self.mode == "auto" and self.parser.skip_special_tokens is not None:
            return {"skip_special_tokens": self.parser.skip_special_tokens}
        return {}

    # ---- answers
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A finished choice's message and finish reason."""
        if self.mode == "none":
            return {"role": "assistant", "content": text}, finish_reason
        stream = self.stream()
        content = "".join(d.get("content") or "" for d in stream.feed(text))
        deltas, finish_reason = stream.finish(finish_reason)
        content += "".join(d.get("content") or "" for d in deltas)
        calls = stream.calls
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = calls
        return message, finish_reason

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One choice's deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) from its text
    deltas; ``calls`` collects the whole calls sent."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self.calls: list[dict] = []
        self._auto = AutoToolStream(tools.parser) if tools.mode == "auto" else None
        self._array = _ArrayCalls() if tools.mode == "required" else None

    def feed(self, text: str) -> list[dict]:
        mode = self.tools.mode
        if mode == "none":
            return [{"content": text}] if text else []
        if mode == "named":
            if not text:
                return []
            if self.calls:
                self.calls[0]["function"]["arguments"] += text
                return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
            return self._send([FunctionCall(self.tools.name, text)])
        if mode == "required":
            return self._send(self._array.feed(text))
        content = self._auto.feed(text)
        return [{"content": content}] if content else []

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas once the output ended, and the choice's finish reason."""
        mode = self.tools.mode
        if mode == "named":  # an empty output is still the call, with empty arguments
            return ([] if self.calls else self._send([FunctionCall(self.tools.name, "")])), finish_reason
        if mode == "required":
            deltas = self._send(self._array.finish())
            return deltas, "tool_calls" if self.calls and finish_reason == "stop" else finish_reason
        if mode == "auto":
            found = self._auto.finish()
            deltas = [{"content": found.content}] if found.content else []
            deltas += self._send(found.calls if self.tools.parallel else found.calls[:1])
            return deltas, "tool_calls" if self.calls else finish_reason
        return [], finish_reason

    def _send(self, found: list[FunctionCall]) -> list[dict]:
        """Deltas opening each call (its index, id, type, name and arguments so far)."""
        deltas = []
        for fc in found:
            call = {"id": self.tools.new_call_id(), "type": "function",
                    "function": {"name": fc.name, "arguments": fc.arguments}}
            deltas.append({"tool_calls": [{"index": len(self.calls), **call, "function": dict(call["function"])}]})
            self.calls.append(call)
        return deltas


class _ArrayCalls:
    """The items of a required choice's JSON array, each once it is complete."""

    def __init__(self) -> None:
        self.text = ""
        self.pos: int | None = None  # where the next item (or the separator before it) starts
        self.count = 0
        self.done = False
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[FunctionCall]:
        self.text += text
        if self.pos is None:
            start = self.text.find("[")
            if start < 0:
                return []
            self.pos = start + 1
        found = []
        while not self.done:
            at = self._skip(self.pos)
            if at < len(self.text) and self.text[at] == "]":
                self.done = True
                break
            if self.count and at < len(self.text) and self.text[at] == ",":
                at = self._skip(at + 1)
            elif self.count:
                break
            try:
                obj, end = self._decoder.raw_decode(self.text, at)
                found.append(parse_call(obj))
            except (ValueError, RecursionError, NotACall):
                break  # not complete yet (or not a call: nothing more is read)
            self.pos, self.count = end, self.count + 1
        return found

    def finish(self) -> list[FunctionCall]:
        return self.feed("")

    def _skip(self, at: int) -> int:
        while at < len(self.text) and self.text[at] in " \t\r\n":
            at += 1
        return at


def _depth(value: Any, level: int = 1) -> int:
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level


def template_message(role: str, tool_calls: Any, tool_call_id: str | None, index: int) -> dict:
    """The tool fields of ``messages[index]`` as the chat template gets them."""
    out: dict[str, Any] = {}
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    if tool_calls is None:
        return out
    where = f"messages[{index}].tool_calls"
    if role != "assistant" or not isinstance(tool_calls, list):
        raise ToolError(f"{where}: only an assistant message has tool_calls, a list of calls", "messages")
    calls = []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                            "{\"name\", \"arguments\"}}", "messages")
        arguments = fn.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise ToolError(f"{where}[{j}].function.arguments is not JSON", "messages") from None
        calls.append({**call, "function": {**fn, "arguments": arguments}})
    out["tool_calls"] = calls
    return out
