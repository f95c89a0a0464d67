"""The OpenAI-compatible routes on one ``AsyncLLM``.

    POST /v1/completions, POST /v1/chat/completions (JSON, or SSE with ``"stream": true``)
    GET /v1/models, GET /health (503 once the engine is dead), GET /metrics (Prometheus),
    GET /version (what routers probe; ``readiness`` adds 503s while loading and draining)

Every check runs before a response starts: connections and headers are bounded in front of the
app (``connections``); a body over ``--max-request-bytes`` is a 413 before it is read, one that
is too slow a 408 (``body_limit``); then decoding under the server's limits (``protocol``,
``limits``), chat templating, tokenizing and grammar compilation run in the preparation queue
(``preparation``: its own few threads, bounded, fair between clients), never on the event loop,
so ``/health`` and every stream keep going while a large request is examined; the request is
queued on the loop. A bad field is a 400 naming it, a limit a 400/413 naming the flag, a full
queue a 429 with ``Retry-After``, a dead engine a 503, all as OpenAI error objects (never over a
few hundred characters of message) and before any byte of a stream. A client that goes away
(streaming or not) aborts its request at once: every response races the request's generation
against the connection's ``http.disconnect``. A request that ends aborted or in error is
reported as an error, never as a finished answer: a 400 when what it asked for was at fault (its
grammar), a 500 otherwise (``responses.request_error_status``).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
import uuid
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenbudget.api.errors import EngineDeadError, EngineOverloadedError, RequestError
from tokenbudget.api.version import package_version
from tokenbudget.engine.entrypoints.memory import TRIM_AFTER_BYTES, release_free_memory
from tokenbudget.engine.serve import protocol as proto
from tokenbudget.engine.serve import responses as resp
from tokenbudget.engine.serve.body_limit import LimitBody
from tokenbudget.engine.serve.chat_stream import ChatChunks
from tokenbudget.engine.serve.limits import LimitError, ServerLimits, flag, prompt_byte_bound
from tokenbudget.engine.serve.metrics import CONTENT_TYPE, ServerMetrics
from tokenbudget.engine.serve.preparation import PreparationQueue
from tokenbudget.engine.serve.tool_parsers import get_parser

_VERSION = package_version()
_OPEN_PATHS = ("/health", "/metrics", "/version")


class _Json(JSONResponse):
    def render(self, content) -> bytes:
        return msgspec.json.encode(content)


def _error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None,
           code: int | str | None = None) -> _Json:
    return _Json(resp.error_body(message, kind, param, code or status), status_code=status, headers=headers)


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race_disconnect(work, receive):
    """Run ``work`` (a coroutine) unless the client disconnects first; (done, result)."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return (True, task.result()) if task in done else (False, None)


class _AbortOnDisconnect(StreamingResponse):
    """An SSE response whose generator is cancelled when the client leaves; ``on_close`` (abort
    the request; a no-op once it finished) runs however the response ends, even when the client
    left before the generator started."""

    def __init__(self, content, on_close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await _race_disconnect(self.stream_response(send), receive)
        finally:
            self.on_close()


class _RequireKey:
    """Plain ASGI middleware (no wrapping of bodies or streams): 401 without the bearer key,
    except for the probe routes."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServer:
    def __init__(self, llm, model_name: str, limits: ServerLimits | None = None,
                 tool_parser: str | None = None) -> None:
        self.llm, self.model_name = llm, model_name
        # --enable-auto-tool-choice --tool-call-parser NAME: tool_choice "auto" read by that parser
        self.tool_parser = get_parser(tool_parser) if tool_parser is not None else None
        self.limits = limits if limits is not None else ServerLimits()
        self.metrics = ServerMetrics(llm, model_name)
        self.token_text = resp.TokenText(llm.tokenizer)
        self.max_model_len = llm.engine.max_model_len
        self.max_prompt_tokens = min(self.limits.max_prompt_tokens or self.max_model_len, self.max_model_len)
        self.byte_bound = prompt_byte_bound(llm.tokenizer) if llm.tokenizer is not None else None
        # Request preparation's own threads, bounded and fair between clients (``preparation``).
        self.preparation = PreparationQueue(2, self.limits.max_preparing_requests,
                                            self.limits.max_preparing_per_client)

    # ---------------------------------------------------------------- requests
    def _prepare(self, body: bytes, chat: bool):
        """In a preparation thread: decode, check the limits, template, tokenize, compile."""
        try:
            return self._prepare_body(body, chat)
        finally:
            if len(body) >= TRIM_AFTER_BYTES:  # its transient allocations (tokenizing: ~300 bytes a token)
                release_free_memory()

    def _prepare_body(self, body: bytes, chat: bool):
        kind = proto.ChatCompletionRequest if chat else proto.CompletionRequest
        req = proto.decode(body, kind, self.limits)
        if req.model is not None and req.model != self.model_name:
            raise proto.ModelNotFoundError(req.model, self.model_name)
        tools = proto.tool_request(req, self.tool_parser) if chat else None
        params = proto.to_sampling_params(req, bool(req.stream), self.llm.engine.sampling_defaults,
                                          tools.sampling_options(self.limits) if tools is not None else None)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        field = "messages" if chat else "prompt"
        if chat:
            messages = proto.chat_messages(req)
            # Every text field of the messages, before the template copies them ...
            self._check_prompt_bytes(b"".join(text.encode("utf-8", "surrogatepass") for m in messages
                                              for text in m.values() if isinstance(text, str)), field)
            prompt = proto.chat_prompt(self.llm.tokenizer, req, messages)
        else:
            prompt = proto.completion_prompt(req)
            if not isinstance(prompt, str) and len(prompt) > self.max_prompt_tokens:
                self._too_many_tokens(len(prompt), field)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str):  # ... and the text that is tokenized, whatever the template added
            self._check_prompt_bytes(text.encode("utf-8", "surrogatepass"), field)
        priority = req.priority or 0
        if priority and self.llm.engine.config.scheduling_policy != "priority":  # vLLM's answer too
            raise ValueError("priority: this server schedules first come, first served; start it with "
                             "--scheduling-policy priority to use request priorities")
        prepared = self.llm.make_request(rid, prompt, params, priority)
        num_prompt = prepared.request.num_prompt_tokens
        if num_prompt > self.max_prompt_tokens:
            self._too_many_tokens(num_prompt, field)
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if asked is not None and num_prompt + asked > self.max_model_len:  # vLLM: a 400, never a silent clamp
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise LimitError(f"this model's maximum context length is {self.max_model_len} tokens; the request "
                             f"asks for {num_prompt + asked} ({num_prompt} in the prompt, {asked} in {name})", name)
        return req, params, prepared, tools

    def _check_prompt_bytes(self, data: bytes, field: str) -> None:
        """Refuse, before tokenizing, a prompt whose bytes alone need more than
        ``max_prompt_tokens`` tokens (``limits.prompt_byte_bound`` says when that is certain)."""
        if self.byte_bound is not None and self.byte_bound.min_tokens(data) > self.max_prompt_tokens:
            raise LimitError(f"{field} is {len(data)} bytes: more than {self.max_prompt_tokens} tokens "
                             f"({self._token_limit()}), whatever its text", field)

    def _too_many_tokens(self, num_tokens: int, field: str) -> None:
        raise LimitError(f"{field} has {num_tokens} tokens, more than {self._token_limit()}", field)

    def _token_limit(self) -> str:
        if self.max_prompt_tokens < self.max_model_len:
            return f"{flag('max_prompt_tokens')}={self.max_prompt_tokens}"
        return f"max_model_len={self.max_model_len}"

    async def handle(self, request: Request, chat: bool) -> Response:
        body = await request.body()
        client = request.client.host if request.client is not None else ""
        done, made = await _race_disconnect(self.preparation.run(client, self._prepare, body, chat), request.receive)
        del body
        if not done:  # the client left while its request waited for (or was in) preparation
            return Response(status_code=499)  # nobody reads it
        req, params, prepared, tools = made
        stream, rid = self.llm.add_made_request(prepared), prepared.request_id
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            if chat:
                render = ChatChunks(rid, created, self.model_name, params.n, params.logprobs or 0, self.token_text,
                                    tools).render
                events = self._events(stream, rid, created, "chat.completion.chunk", include_usage, render)
            else:
                events = self._completion_events(stream, rid, created, params.logprobs or 0, include_usage)
            return _AbortOnDisconnect(events, functools.partial(self.llm.abort, rid), media_type="text/event-stream")
        done, out = await _race_disconnect(self._final(stream), request.receive)
        if not done:
            self.llm.abort(rid)
            return Response(status_code=499)  # nobody reads it
        self.metrics.observe(out)
        if any(c.finish_reason == "abort" for c in out.outputs):
            return _error(503, "the request was aborted (the server is shutting down)", "server_error")
        if chat:
            return _Json(resp.chat_object(rid, created, self.model_name, out, params.logprobs or 0, self.token_text,
                                          tools))
        return _Json(resp.completion_object(rid, created, self.model_name, out, params.logprobs or 0, self.token_text))

    async def _final(self, stream):
        try:
            async for out in stream:
                last = out
            return last
        except RequestError as exc:
            if exc.output is not None:
                self.metrics.observe(exc.output)
            raise

    async def _events(self, stream, rid: str, created: int, obj: str, include_usage: bool, render):
        """SSE events: ``render(out)`` per output, usage, ``[DONE]``; an error event (and no
        ``[DONE]``) when the request is aborted or fails."""
        n_out, last = 0, None
        try:
            async for out in stream:
                last = out
                if any(c.finish_reason == "abort" for c in out.outputs):
                    yield _sse(resp.error_body("the request was aborted", "server_error", code=503))
                    return
                n_out += sum(len(c.token_ids) for c in out.outputs)
                for event in render(out):
                    yield _sse(event)
            self.metrics.observe(last)
            if include_usage:
                yield _sse(resp.usage_chunk(rid, created, self.model_name, obj, len(last.prompt_token_ids), n_out,
                                            last.metrics))
            yield b"data: [DONE]\n\n"
        except RequestError as exc:
            status, param = resp.request_error_status(exc.output.error if exc.output is not None else None)
            kind = "invalid_request_error" if status < 500 else "server_error"
            yield _sse(resp.error_body(str(exc), kind, param, code=status))
        except EngineDeadError as exc:
            yield _sse(resp.error_body(str(exc), "server_error", code=500))
        finally:
            if not stream.finished:
                self.llm.abort(rid)

    def _completion_events(self, stream, rid, created, n_logprobs, include_usage):
        offsets: dict[int, int] = {}  # each choice's text offset so far

        def render(out):
            chunks = []
            for c in out.outputs:
                at = offsets.get(c.index, 0)
                chunks.append(resp.completion_chunk(rid, created, self.model_name, c, n_logprobs, self.token_text, at))
                offsets[c.index] = at + len(c.text)
            return chunks

        return self._events(stream, rid, created, "text_completion", include_usage, render)


def build_app(llm, model_name: str, api_key: str | None = None, limits: ServerLimits | None = None,
              tool_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` (an ``AsyncLLM``) as ``model_name`` under ``limits``;
    ``tool_parser``: tool_choice "auto" is on, read by that parser (``tool_parsers``)."""
    server = OpenAIServer(llm, model_name, limits, tool_parser)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await llm.shutdown()  # after the drain: abort what is left
        server.preparation.shutdown()

    app = FastAPI(title="tokenbudget", lifespan=lifespan)
    app.state.server = server

    app.add_middleware(LimitBody, max_request_bytes=server.limits.max_request_bytes,
                       timeout_body=server.limits.timeout_body)
    if api_key is not None:  # added last: runs first, so a body is never read without the key
        app.add_middleware(_RequireKey, api_key=api_key)

    @app.exception_handler(LimitError)
    async def past_limit(request, exc: LimitError):
        return _error(exc.status, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(proto.ModelNotFoundError)
    async def unknown_model(request, exc: proto.ModelNotFoundError):  # OpenAI's and vLLM's 404
        return _error(404, str(exc), "invalid_request_error", "model", code="model_not_found")

    @app.exception_handler(proto.ProtocolError)
    async def bad_body(request, exc: proto.ProtocolError):
        return _error(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(ValueError)
    async def bad_value(request, exc: ValueError):  # from AsyncLLM.add_request: the prompt, mostly
        word = str(exc).split(" ", 1)[0].rstrip(":").split(".", 1)[0]
        word = "response_format" if word == "structured_outputs" else word  # the one field that maps to it
        return _error(400, str(exc), "invalid_request_error", word if word in proto.FIELDS else "prompt")

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(request, exc: EngineOverloadedError):
        return _error(429, str(exc), "rate_limit_error", headers={"Retry-After": str(max(1, round(exc.retry_after)))})

    @app.exception_handler(EngineDeadError)
    async def dead(request, exc: EngineDeadError):
        return _error(503, str(exc), "server_error")

    @app.exception_handler(RequestError)
    async def failed(request, exc: RequestError):
        status, param = resp.request_error_status(exc.output.error if exc.output is not None else None)
        return _error(status, str(exc), "invalid_request_error" if status < 500 else "server_error", param)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return _Json({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                  "owned_by": "tokenbudget", "root": llm.engine.config.model
                                                  or model_name, "parent": None,
                                                  "max_model_len": llm.engine.max_model_len}]})

    @app.get("/version")
    async def version():
        return _Json({"version": _VERSION})

    @app.get("/health")
    async def health():
        if llm.is_healthy():
            return Response(status_code=200)
        return _error(503, "the engine is dead", "server_error")

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app
