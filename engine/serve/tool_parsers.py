"""Tool calls written in a model's own output (``tool_choice: "auto"``), in the formats vLLM's
``--tool-call-parser`` names:

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3, ...): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one block per call; the content is the text before the first block (vLLM's).
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the output is ``{"name": ...,
  "parameters": {...}}`` (or ``"arguments"``), several separated by ``;``, after an optional
  ``<|python_tag|>``; no content. As in vLLM's streaming parser the output must begin with the
  call (vLLM's non-streaming parser also finds a JSON object later in the text; here both modes
  agree).
* ``mistral`` (Mistral 7B v0.3, Nemo, Small, ...): ``[TOOL_CALLS]`` then a JSON list of
  ``{"name", "arguments"}`` (pre-v11 tokenizers), or ``name{...}`` / ``name[ARGS]{...}`` after
  each ``[TOOL_CALLS]`` (v11+); the content is the text before the first marker. ``[TOOL_CALLS]``
  is a control token, so this parser decodes with special tokens kept (vLLM's ``adjust_request``),
  and its call ids are 9 alphanumerics (what Mistral's templates accept back).

``extract(text)`` is vLLM's ``extract_tool_calls``: the calls with their arguments as JSON text
(``json.dumps(arguments, ensure_ascii=False)``), or, when no call parses, the whole text as
content and no call. ``AutoToolStream`` streams one choice: content as it arrives up to where a
call may begin (a text that could still become a marker is held back), nothing while a call is
being written, then at the end ``extract`` of the whole text. So the streamed content and calls
are exactly the non-streamed ones, whatever the deltas (a call is sent whole, in one delta, once
the output ends; vLLM streams the arguments in pieces).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class FunctionCall:
    name: str
    arguments: str  # a JSON object as text


@dataclass(frozen=True, slots=True)
class Extracted:
    content: str | None  # None: no text besides the calls
    calls: list[FunctionCall] = field(default_factory=list)


class NotACall(ValueError):
    pass


def parse_call(obj: Any, name: str | None = None) -> FunctionCall:
    """A call from a parsed object (``{"name", "arguments" | "parameters"}``), or from ``name`` and
    ``obj`` as its arguments."""
    if name is None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise NotACall("a tool call needs a string 'name'")
        name, obj = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    if isinstance(obj, str):  # arguments written as a JSON string of the object
        obj = _loads(obj)
    if not isinstance(obj, dict) or not name:
        raise NotACall("a tool call's arguments must be a JSON object")
    return FunctionCall(name, json.dumps(obj, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise NotACall(str(exc)) from None


def _held_back(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (it may still become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolParser:
    """One output format. ``content_end(text)``: ``(end, started)`` for the text so far: the
    content before ``end`` is final; ``started``: a call has begun (nothing more is content
    unless no call parses at the end)."""

    name: ClassVar[str]
    skip_special_tokens: ClassVar[bool | None] = None  # None: the request's own

    def extract(self, text: str) -> Extracted:
        try:
            return self._extract(text)
        except NotACall:
            return Extracted(text)

    def _extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def content_end(self, text: str) -> tuple[int, bool]:
        raise NotImplementedError

    @staticmethod
    def new_call_id() -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's


class _MarkedParser(ToolParser):
    """Calls after a marker; the content is what precedes the first marker."""

    marker: ClassVar[str]

    def content_end(self, text: str) -> tuple[int, bool]:
        at = text.find(self.marker)
        if at >= 0:
            return at, True
        return len(text) - _held_back(text, self.marker), False

    def _extract(self, text: str) -> Extracted:
        at = text.find(self.marker)
        if at < 0:
            return Extracted(text)
        calls = self._calls(text[at:])
        if not calls:
            raise NotACall("no tool call")
        return Extracted(text[:at] or None, calls)

    def _calls(self, text: str) -> list[FunctionCall]:
        raise NotImplementedError


class HermesParser(_MarkedParser):
    name = "hermes"
    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def _calls(self, text: str) -> list[FunctionCall]:
        return [parse_call(_loads(closed or open_)) for closed, open_ in self._BLOCK.findall(text)]


class MistralParser(_MarkedParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    skip_special_tokens = False
    _NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*")
    _ID_CHARS = string.ascii_letters + string.digits

    def _calls(self, text: str) -> list[FunctionCall]:
        calls: list[FunctionCall] = []
        decoder = json.JSONDecoder()
        for part in text.split(self.marker)[1:]:
            part = part.strip()
            if part.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
                items = _loads(part)
                if not isinstance(items, list):
                    raise NotACall("not a list of calls")
                calls += [parse_call(item) for item in items]
                continue
            name, sep, args = part.partition("[ARGS]")
            if sep:  # name[ARGS]{...}
                calls.append(parse_call(_loads(args), name.strip()))
                continue
            pos = 0
            while pos < len(part):  # name{...}, name{...}
                m = self._NAME.match(part, pos)
                if m is None:
                    raise NotACall("a call must start with a function name")
                try:
                    args, pos = decoder.raw_decode(part, m.end())
                except (ValueError, RecursionError) as exc:
                    raise NotACall(str(exc)) from None
                calls.append(parse_call(args, m.group(1)))
                while pos < len(part) and part[pos] in ", \n\t":
                    pos += 1
        return calls

    @classmethod
    def new_call_id(cls) -> str:
        return "".join(secrets.choice(cls._ID_CHARS) for _ in range(9))


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    _TAG = "<|python_tag|>"

    def content_end(self, text: str) -> tuple[int, bool]:
        s = text.lstrip()
        if not s or self._TAG.startswith(s):
            return 0, False  # undecided: whitespace, or what may become the tag
        if s.startswith("{") or s.startswith(self._TAG):
            return 0, True
        return len(text), False  # plain text: all of it is content, for good

    def _extract(self, text: str) -> Extracted:
        s = text.lstrip()
        s = s[len(self._TAG):].lstrip() if s.startswith(self._TAG) else s
        if not s.startswith("{"):
            return Extracted(text)
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while True:
            try:
                obj, pos = decoder.raw_decode(s, pos)
            except (ValueError, RecursionError) as exc:
                raise NotACall(str(exc)) from None
            calls.append(parse_call(obj))
            rest = s[pos:].lstrip()
            if not rest:
                return Extracted(None, calls)
            if not rest.startswith(";"):
                raise NotACall("calls are separated by ';'")
            s, pos = rest[1:].lstrip(), 0


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    """The parser vLLM names ``name``; ``ValueError`` listing the names otherwise."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(PARSERS))}, got {name!r}")
    return PARSERS[name]()


class AutoToolStream:
    """One streamed choice under ``tool_choice: "auto"`` (module docstring)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.started = False

    def feed(self, delta: str) -> str:
        """The content to send now for ``delta``."""
        self.text += delta
        if self.started:
            return ""
        end, self.started = self.parser.content_end(self.text)
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> Extracted:
        """The rest of the content (the text after what was sent; None when nothing is left) and
        every call, once the output has ended."""
        found = self.parser.extract(self.text)
        rest = (found.content or "")[self.sent:]
        return Extracted(rest or None, found.calls)
