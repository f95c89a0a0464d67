"""OpenAI request bodies, and the one mapping from a body to ``SamplingParams``.

Bodies decode strictly (msgspec, ``forbid_unknown_fields``): an unknown field or a value of the
wrong type is a ``ProtocolError`` naming the field, answered with HTTP 400 before anything runs.
Values are then checked by ``SamplingParams`` itself (its ``ValueError`` names the field).

``to_sampling_params`` is the only place that knows how OpenAI (and vLLM's extra) fields become
``SamplingParams``: new sampling features are mapped here. OpenAI fields the engine cannot honour
yet are accepted by the decoder (the official client may send them) but refused with a 400 when
set to anything but their neutral value: ``NOT_MAPPED`` lists them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams
from tokenbudget.engine.serve.limits import ServerLimits, check_counts, check_depth
from tokenbudget.engine.serve.tool_calls import ToolError, ToolRequest, template_message
from tokenbudget.engine.text.chat_template import check_chat_template_kwargs

# OpenAI fields not mapped yet (the sampling-parity work adds them to SamplingParams), with the
# value that means "not used".
NOT_MAPPED: dict[str, Any] = {"best_of": None, "echo": False, "suffix": None}


def _structured_outputs(response_format: dict[str, Any] | None):
    """OpenAI's ``response_format`` as ``StructuredOutputsParams`` (None for plain text):
    ``{"type": "json_schema", "json_schema": {"schema": {...}, ...}}`` or ``{"type": "json_object"}``."""
    from tokenbudget.api.structured_params import StructuredOutputsParams

    kind = (response_format or {}).get("type", "text")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema object")
            return StructuredOutputsParams(json=spec["schema"])
    except ValueError as exc:
        raise ProtocolError(f"response_format: {exc}", "response_format") from None
    raise ProtocolError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                        "response_format")


class ProtocolError(ValueError):
    """A bad request body; ``param`` is the offending field (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(ValueError):
    """A body's ``model`` that this server does not serve: a 404 with code ``model_not_found``
    (OpenAI's answer, and vLLM's status), not a 400."""

    def __init__(self, asked: str, served: str) -> None:
        super().__init__(f"The model {asked!r} does not exist: this server serves {served!r}")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class SpeculativeOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Per-request speculation: 0 = off, k = at most k drafts per step, "auto" = the engine's."""

    num_speculative_tokens: int | Literal["auto"] = "auto"


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    speculative: SpeculativeOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None
    n: int | None = 1
    # vLLM's: the scheduler's priority policy (--scheduling-policy priority) runs lower values first
    priority: int | None = 0


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[int | str | list[int]]  # a string, token ids, or a list of one of them
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (``tool_calls``)
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatCompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extra chat fields
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


FIELDS = frozenset(CompletionRequest.__struct_fields__) | frozenset(ChatCompletionRequest.__struct_fields__)

_AT = re.compile(r"at `\$\.([A-Za-z_][\w]*)")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_REQUIRED = re.compile(r"missing required field `([^`]+)`")


def decode(body: bytes, kind: type[_Common], limits: ServerLimits | None = None) -> _Common:
    """The request body as ``kind``; ``ProtocolError`` naming the field otherwise, ``LimitError``
    naming the field and the limit past ``limits`` (each field's nesting depth is measured on the
    raw JSON before anything decodes it)."""
    limits = limits if limits is not None else ServerLimits()
    check_depth(body, limits)
    try:
        req = msgspec.json.decode(body, type=kind)
    except RecursionError:  # unreachable under the depth limits; never a bare 500
        raise ProtocolError("the request body is nested too deeply") from None
    except msgspec.ValidationError as exc:
        msg = str(exc)
        found = _UNKNOWN.search(msg) or _AT.search(msg) or _REQUIRED.search(msg)
        param = found.group(1) if found else None
        if _UNKNOWN.search(msg):
            msg = f"unknown field {param!r}: not an OpenAI (or supported vLLM) request field"
        raise ProtocolError(msg, param) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"the request body is not valid JSON: {exc}") from None
    check_counts(req, limits)
    return req


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """One prompt: a string or token ids (a list of one of them is accepted)."""
    prompt = req.prompt
    if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise ProtocolError("prompt: only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise ProtocolError("prompt must not be empty", "prompt")
    return prompt


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages for the chat template; content parts of type "text" are joined; ``name`` and the
    tool fields pass on (``tool_calls.template_message``)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise ProtocolError(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(str(part.get("text", "")) for part in content)
        message = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls is not None or m.tool_call_id is not None:
            try:
                message.update(template_message(m.role, m.tool_calls, m.tool_call_id, i))
            except ToolError as exc:
                raise ProtocolError(str(exc), exc.param) from None
        out.append(message)
    if not out:
        raise ProtocolError("messages must not be empty", "messages")
    return out


def chat_prompt(tokenizer, req: ChatCompletionRequest, messages: list[dict]) -> dict[str, Any]:
    """The engine prompt of a chat body (``Tokenizer.chat_prompt``); ``ProtocolError`` naming
    ``chat_template_kwargs``, ``continue_final_message`` or, when the chat template refuses or
    goes past its limits, ``messages``."""
    try:
        check_chat_template_kwargs(req.chat_template_kwargs)
    except ValueError as exc:
        raise ProtocolError(str(exc), "chat_template_kwargs") from None
    if req.continue_final_message and req.add_generation_prompt:
        raise ProtocolError("continue_final_message and add_generation_prompt cannot both be true",
                            "continue_final_message")
    try:
        return tokenizer.chat_prompt(messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template_kwargs=req.chat_template_kwargs, tools=req.tools)
    except ValueError as exc:
        raise ProtocolError(str(exc), "messages") from None


def _check_not_mapped(req: _Common) -> None:
    for name, neutral in NOT_MAPPED.items():
        value = getattr(req, name, neutral)
        if value is None or value == neutral:
            continue
        raise ProtocolError(f"{name} is not supported yet (got {value!r})", name)


def tool_request(req: ChatCompletionRequest, parser) -> ToolRequest:
    """The body's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (``tool_calls``), read
    with the server's auto parser (None: ``--enable-auto-tool-choice`` is off)."""
    try:
        return ToolRequest.from_body(req.tools, req.tool_choice, req.parallel_tool_calls, parser)
    except ToolError as exc:
        raise ProtocolError(str(exc), exc.param) from None


def to_sampling_params(req: _Common, stream: bool, defaults: dict[str, Any] | None = None,
                       tool_options: dict[str, Any] | None = None) -> SamplingParams:
    """The ``SamplingParams`` of a completion or chat body; ``ProtocolError`` naming the field.
    ``defaults`` (the model's recommended sampling, ``LLMEngine.sampling_defaults``) fill the
    fields the body leaves unset, as vLLM's ``--generation-config auto``; ``tool_options``
    (``ToolRequest.sampling_options``) are what its tool choice sets."""
    _check_not_mapped(req)
    opts: dict[str, Any] = dict(defaults or {})
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest):
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        if req.logprobs:
            opts["logprobs"] = req.top_logprobs or 0
        elif req.top_logprobs is not None:
            raise ProtocolError("top_logprobs needs logprobs: true", "top_logprobs")
    elif req.logprobs is not None:
        opts["logprobs"] = req.logprobs
    if max_tokens is not None:
        opts["max_tokens"] = max_tokens
    elif isinstance(req, ChatCompletionRequest) and "max_tokens" not in opts:
        opts["max_tokens"] = 2**20  # OpenAI chat: until the model stops (the context length caps it)
    for name in ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "min_tokens", "ignore_eos",
                 "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logit_bias"):
        value = getattr(req, name)
        if value is not None:
            opts[name] = value
    if req.speculative is not None and req.speculative.num_speculative_tokens != "auto":
        opts["num_speculative_tokens"] = req.speculative.num_speculative_tokens
    if req.n is not None and req.n != 1:
        opts["n"] = req.n
    structured = _structured_outputs(getattr(req, "response_format", None))
    if structured is not None:
        opts["structured_outputs"] = structured
    if tool_options:
        if structured is not None and "structured_outputs" in tool_options:
            raise ProtocolError("response_format cannot be combined with tool_choice \"required\" or a named "
                                "function (both constrain the output)", "response_format")
        opts.update(tool_options)
    opts["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**opts)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise ProtocolError(str(exc), "max_completion_tokens" if field == "max_tokens" and isinstance(
            req, ChatCompletionRequest) and req.max_completion_tokens is not None else field) from None
