"""``VllmEngine`` over an ``AsyncLLM``: the RPCs of the SMG gRPC worker protocol.

``Generate`` streams, per completion index, a ``GenerateStreamChunk`` for each step's new tokens
(token ids, their logprobs when asked, the prompt's logprobs in the first chunk) and a
``GenerateComplete`` with the finish reason ("stop", "length", "abort", "error"), the matched
stop token or string and the usage counts; without ``stream``, one ``GenerateComplete`` per
completion with all its tokens. A client that cancels the call, and ``Abort``, free the request
in the engine before its next step (``AsyncLLM.abort``). A bad or unsupported field is
INVALID_ARGUMENT naming it (``sampling``), an engine past its admission bounds
RESOURCE_EXHAUSTED, a dead engine UNAVAILABLE.

The engine is ``None`` while it loads and the server is ``draining`` after a SIGTERM: then
``HealthCheck`` says so (healthy false, with why) and ``Generate`` answers UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
import zipfile
from datetime import UTC, datetime

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from tokenbudget.api.errors import EngineDeadError, EngineOverloadedError, RequestError
from tokenbudget.integrations.grpc.kv_stream import kv_event_batches
from tokenbudget.integrations.grpc.sampling import prompt_of, sampling_params_of

TOKENIZER_CHUNK_BYTES = 1 << 20


class TokenbudgetServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, model_name: str, model_path: str) -> None:
        self.llm = None  # the AsyncLLM, once loaded
        self.load_error: str | None = None
        self.draining = False
        self.model_name, self.model_path = model_name, model_path
        self.start_time = time.time()
        self.last_receive = 0.0

    def ready(self, llm) -> None:
        """The engine has loaded: attach the KV-event log before any request, then serve."""
        llm.kv_events()
        self.llm = llm

    def _not_ready(self) -> str | None:
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.llm is None:
            return "loading the model"
        if self.draining:
            return "draining: shutting down"
        if not self.llm.is_healthy():
            return "the engine is dead"
        return None

    async def _engine(self, context):
        why = self._not_ready()
        if why is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        return self.llm

    # ------------------------------------------------------------------ generation
    async def Generate(self, request, context):
        llm = await self._engine(context)
        self.last_receive = time.time()
        try:
            prompt = prompt_of(request)
            params = sampling_params_of(request.sampling_params, llm.engine.get_default_sampling_params(),
                                        request.stream)
            stream = llm.add_request(request.request_id or None, prompt, params)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineOverloadedError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        num_logprobs = params.logprobs
        sent: dict[int, int] = {}  # completion index -> tokens sent
        first = True
        try:
            async for out in stream:
                prompt_tokens = len(out.prompt_token_ids)
                cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
                input_logprobs = _input_logprobs(out) if first else None
                for c in out.outputs:
                    if request.stream:
                        if c.token_ids or first:
                            sent[c.index] = sent.get(c.index, 0) + len(c.token_ids)
                            chunk = pb.GenerateStreamChunk(
                                token_ids=c.token_ids, prompt_tokens=prompt_tokens, completion_tokens=sent[c.index],
                                cached_tokens=cached, index=c.index,
                                output_logprobs=_output_logprobs(c, num_logprobs), input_logprobs=input_logprobs)
                            yield pb.GenerateResponse(chunk=chunk)
                        if c.finish_reason is not None:
                            yield pb.GenerateResponse(complete=_complete(c, [], sent.get(c.index, 0), prompt_tokens,
                                                                         cached, out, None, None))
                    elif c.finish_reason is not None:
                        yield pb.GenerateResponse(complete=_complete(
                            c, c.token_ids, len(c.token_ids), prompt_tokens, cached, out,
                            _output_logprobs(c, num_logprobs), _input_logprobs(out)))
                first = False
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:  # the client cancelled (or the call failed): free the request in the engine
            if not stream.finished:
                llm.abort(stream.request_id)

    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed: this engine serves generation models only")

    async def Abort(self, request, context):
        if self.llm is not None:
            for rid in request.request_ids:
                self.llm.abort(rid)
        return pb.AbortResponse()

    # ------------------------------------------------------------------ state
    async def HealthCheck(self, request, context):
        why = self._not_ready()
        return pb.HealthCheckResponse(healthy=why is None, message=why or "healthy")

    async def GetModelInfo(self, request, context):
        llm = await self._engine(context)
        engine, tok = llm.engine, llm.tokenizer
        eos = tok.eos_token_ids
        defaults = {k: v for k, v in engine.sampling_defaults.items()}
        return pb.GetModelInfoResponse(
            model_path=self.model_path, is_generation=True, max_context_length=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size, supports_vision=False, served_model_name=self.model_name,
            tokenizer_path="", model_type=engine.model_config.architecture,
            architectures=[engine.model_config.architecture], eos_token_ids=eos,
            pad_token_id=eos[0] if eos else 0, bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else 0,
            max_req_input_len=engine.max_model_len - 1, default_sampling_params_json=json.dumps(defaults))

    async def GetServerInfo(self, request, context):
        llm = await self._engine(context)
        stats = llm.get_stats()
        cfg = llm.engine.scheduler.config
        return pb.GetServerInfoResponse(
            active_requests=stats.num_running + stats.num_waiting, is_paused=self.draining,
            last_receive_timestamp=self.last_receive, uptime_seconds=time.time() - self.start_time,
            server_type="vllm-grpc", data_parallel_size=1, block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs, model_dtype=str(llm.engine.config.dtype or ""))

    async def GetLoads(self, request, context):
        llm = await self._engine(context)
        s = llm.get_stats()
        cfg = llm.engine.scheduler.config
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=s.num_running, num_waiting_reqs=s.num_waiting,
            num_total_reqs=s.num_running + s.num_waiting, num_used_tokens=s.kv_blocks_used * cfg.block_size,
            max_total_num_tokens=s.kv_blocks_total * cfg.block_size, token_usage=s.kv_usage,
            gen_throughput=s.generation_tokens_per_s, cache_hit_rate=hit_rate,
            utilization=s.num_running / cfg.max_num_seqs, max_running_requests=cfg.max_num_seqs,
            num_waiting_uncached_tokens=s.num_waiting_tokens)
        return pb.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(), version="tokenbudget",
                                   dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context):
        llm = await self._engine(context)
        data = await asyncio.to_thread(tokenizer_zip, llm.tokenizer)
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield common_pb2.GetTokenizerChunk(data=data[start:end], sha256=digest if end >= len(data) else "")

    async def FlushCache(self, request, context):
        llm = await self._engine(context)
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        while True:
            if llm.reset_prefix_cache():
                return common_pb2.FlushCacheResponse(success=True, message="prefix cache cleared")
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(success=False, message="requests in flight")
            await asyncio.sleep(0.05)

    async def SubscribeKvEvents(self, request, context):
        llm = await self._engine(context)
        async for batch in kv_event_batches(llm.kv_events()):
            yield batch


def tokenizer_zip(tokenizer) -> bytes:
    """``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template) in a zip:
    what the gateway builds its tokenizer and chat template from (GGUF models included)."""
    config = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
              "chat_template": tokenizer.chat_template, "tokenizer_class": "PreTrainedTokenizerFast"}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("tokenizer.json", tokenizer.backend.to_str())
        z.writestr("tokenizer_config.json", json.dumps({k: v for k, v in config.items() if v is not None}))
    return buf.getvalue()


def _complete(c, output_ids, completion_tokens, prompt_tokens, cached, out, output_logprobs, input_logprobs):
    done = pb.GenerateComplete(output_ids=output_ids, finish_reason=c.finish_reason, prompt_tokens=prompt_tokens,
                               completion_tokens=completion_tokens, cached_tokens=cached, index=c.index,
                               output_logprobs=output_logprobs, input_logprobs=input_logprobs)
    if isinstance(c.stop_reason, int):
        done.matched_token_id = c.stop_reason
    elif isinstance(c.stop_reason, str):
        done.matched_stop_str = c.stop_reason
    if out.metrics is not None:
        done.spec_accepted_tokens = out.metrics.num_accepted_tokens
        done.spec_draft_tokens = out.metrics.num_draft_tokens
    return done


def _top(entry: dict, k: int) -> pb.TopLogProbs:
    ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
    return pb.TopLogProbs(values=[lp.logprob for _, lp in ranked], token_ids=[t for t, _ in ranked])


def _output_logprobs(c, k: int | None) -> pb.OutputLogProbs | None:
    if k is None or not c.logprobs:
        return None
    return pb.OutputLogProbs(token_logprobs=[entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)],
                             token_ids=c.token_ids,
                             top_logprobs=[_top(entry, k) for entry in c.logprobs] if k > 0 else [])


def _input_logprobs(out) -> pb.InputLogProbs | None:
    if not out.prompt_logprobs:
        return None
    values = [pb.InputTokenLogProb() if entry is None or t not in entry
              else pb.InputTokenLogProb(value=entry[t].logprob)
              for t, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]
    return pb.InputLogProbs(token_logprobs=values, token_ids=out.prompt_token_ids)
