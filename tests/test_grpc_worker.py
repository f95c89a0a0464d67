"""The SMG gRPC worker (tokenbudget/integrations/grpc) over loopback, on the default model.

A real gRPC client against ``VllmEngine``: greedy outputs (streamed and not) equal the offline
engine's; logprobs and finish reasons as the proto says; unsupported fields are INVALID_ARGUMENT
naming them; ``Abort`` and a cancelled call free the request's KV blocks; ``HealthCheck`` is
unhealthy while the model loads; the KV-event stream starts with a snapshot and then carries
the stored blocks of a prompt (hash chain, token ids) and a clear on ``FlushCache``; the
tokenizer bundle encodes as the engine does.
"""

from __future__ import annotations

import io
import json
import threading
import time
import zipfile

import pytest

grpc = pytest.importorskip("grpc", reason="needs the [grpc] extra (pip install 'tokenbudget[grpc]')")
pytest.importorskip("smg_grpc_proto", reason="needs the [grpc] extra (pip install 'tokenbudget[grpc]')")
from smg_grpc_proto import vllm_engine_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import common_pb2  # noqa: E402

from tokenbudget import LLM, AsyncLLM, SamplingParams  # noqa: E402
from tokenbudget.kv_cache.hashing import ROOT_HASH  # noqa: E402

from engine_fixtures import ENGINE_OPTS, default_target  # noqa: E402
from grpc_fixtures import grpc_worker  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]


@pytest.fixture(scope="module")
def worker():
    with grpc_worker(lambda: AsyncLLM(default_target(), **ENGINE_OPTS)) as (stub, servicer):
        deadline = time.monotonic() + 120
        while not stub.HealthCheck(pb.HealthCheckRequest()).healthy:
            assert time.monotonic() < deadline, "the worker never became healthy"
            time.sleep(0.1)
        yield stub, servicer


@pytest.fixture(scope="module")
def offline():
    return LLM(default_target(), **ENGINE_OPTS)


def _wait_free(servicer, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        s = servicer.llm.get_stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0:
            return s
        assert time.monotonic() < deadline, f"KV still held: {s}"
        time.sleep(0.05)


def _request(rid, ids, stream, max_tokens=12, **params):
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
                              sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))


def test_greedy_equals_offline_streamed_and_not(worker, offline):
    stub, servicer = worker
    tok = offline.tokenizer
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    results: dict = {}

    def run(i, stream):
        ids = tok.encode(PROMPTS[i], add_special_tokens=True)
        tokens, completes = [], []
        for resp in stub.Generate(_request(f"g{i}-{stream}", ids, stream)):
            if resp.HasField("chunk"):
                tokens.extend(resp.chunk.token_ids)
                assert resp.chunk.completion_tokens == len(tokens) and resp.chunk.prompt_tokens == len(ids)
            else:
                completes.append(resp.complete)
        assert len(completes) == 1
        if not stream:
            tokens = list(completes[0].output_ids)
        results[i, stream] = (tokens, completes[0])

    threads = [threading.Thread(target=run, args=(i, s)) for i in range(len(PROMPTS)) for s in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(len(PROMPTS)):
        for stream in (True, False):
            tokens, complete = results[i, stream]
            assert tokens == expected[i], (i, stream)
            assert complete.finish_reason in ("length", "stop") and complete.completion_tokens == len(tokens)
    _wait_free(servicer)


def test_logprobs_and_stop_token(worker, offline):
    stub, _ = worker
    ids = offline.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0]
    want = ref.outputs[0]
    got = [r for r in stub.Generate(_request("lp", ids, False, max_tokens=6, logprobs=2))][0].complete
    assert list(got.output_ids) == want.token_ids
    assert got.output_logprobs.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(want.token_ids,
                                                                                            want.logprobs)], abs=1e-5)
    assert all(len(top.token_ids) == 2 and top.token_ids[0] == t
               for top, t in zip(got.output_logprobs.top_logprobs, want.token_ids))  # greedy: the best first
    stop_at = want.token_ids[2]
    done = [r for r in stub.Generate(_request("st", ids, True, max_tokens=6, stop_token_ids=[stop_at]))][-1].complete
    assert done.finish_reason == "stop" and done.matched_token_id == stop_at


@pytest.mark.parametrize("field, request_", [
    ("structural_tag", _request("u1", [1, 2, 3], True, structural_tag="{}")),
    ("mm_inputs", pb.GenerateRequest(request_id="u2", tokenized=pb.TokenizedInput(input_ids=[1, 2]),
                                     mm_inputs=pb.MultimodalInputs(mm_hashes=["x"]))),
    ("data_parallel_rank", pb.GenerateRequest(request_id="u3", tokenized=pb.TokenizedInput(input_ids=[1, 2]),
                                              data_parallel_rank=1)),
    ("max_tokens", _request("u4", [1, 2, 3], True, max_tokens=0)),  # the engine's own ValueError
])
def test_unsupported_or_bad_fields_are_invalid_argument(worker, field, request_):
    stub, servicer = worker
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    _wait_free(servicer)


def test_abort_and_cancel_free_the_kv(worker, offline):
    stub, servicer = worker
    ids = offline.tokenizer.encode(PROMPTS[2], add_special_tokens=True)
    call = stub.Generate(_request("ab", ids, True, max_tokens=400, ignore_eos=True))
    first = next(call)
    assert first.chunk.token_ids
    assert servicer.llm.get_stats().kv_blocks_used > 0
    stub.Abort(pb.AbortRequest(request_ids=["ab"]))
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"
    _wait_free(servicer)
    call = stub.Generate(_request("cx", ids, True, max_tokens=400, ignore_eos=True))
    next(call)
    call.cancel()  # the client goes away: the engine frees the request
    _wait_free(servicer)


def test_kv_events_snapshot_stored_chain_and_flush(worker, offline):
    stub, servicer = worker
    _wait_free(servicer)
    assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5)).success
    block_size = stub.GetServerInfo(pb.GetServerInfoRequest()).block_size
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    snap = next(events)
    assert snap.HasField("snapshot") and snap.events[0].HasField("cleared") and len(snap.events) == 1
    ids = offline.tokenizer.encode(" ".join(PROMPTS) * 2, add_special_tokens=True)
    list(stub.Generate(_request("kv", ids, False, max_tokens=2)))
    stored, seq = [], snap.sequence_number
    while len(stored) < len(ids) // block_size:
        batch = next(events)
        assert batch.sequence_number == seq + 1
        seq = batch.sequence_number
        stored += [e.stored for e in batch.events if e.HasField("stored")]
    parent = ROOT_HASH
    for i, s in enumerate(stored[:len(ids) // block_size]):
        block = s.blocks[0]
        assert list(block.token_ids) == ids[i * block_size:(i + 1) * block_size] and block.block_size == block_size
        assert (s.parent_block_hash if s.HasField("parent_block_hash") else ROOT_HASH) == parent
        assert hash((parent, tuple(block.token_ids))) == block.block_hash
        parent = block.block_hash
    late = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    late_snap = next(late)  # a late subscriber: the live blocks at the current sequence
    assert late_snap.sequence_number == seq
    assert {e.stored.blocks[0].block_hash for e in late_snap.events[1:]} >= {s.blocks[0].block_hash for s in stored}
    late.cancel()
    _wait_free(servicer)
    assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5)).success
    assert next(events).events[0].HasField("cleared")
    events.cancel()


def test_model_info_loads_and_tokenizer(worker, offline):
    stub, servicer = worker
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.is_generation and info.max_context_length == 512 and info.served_model_name == "smol"
    loads = stub.GetLoads(pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests > 0
    data = b"".join(c.data for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    from tokenizers import Tokenizer
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        backend = Tokenizer.from_str(z.read("tokenizer.json").decode())
        config = json.loads(z.read("tokenizer_config.json"))
    text = "Hello, world! The quick brown fox."
    assert backend.encode(text, add_special_tokens=False).ids == offline.tokenizer.encode(text)
    assert config["eos_token"] == offline.tokenizer.eos_token


def test_health_is_honest_while_loading():
    release = threading.Event()

    def slow_load():
        release.wait(30)
        raise RuntimeError("no model here")

    with grpc_worker(slow_load) as (stub, _):
        health = stub.HealthCheck(pb.HealthCheckRequest())
        assert not health.healthy and "loading" in health.message
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_request("x", [1, 2], True)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        release.set()
        deadline = time.monotonic() + 10
        while "failed to load" not in stub.HealthCheck(pb.HealthCheckRequest()).message:
            assert time.monotonic() < deadline
            time.sleep(0.05)
