"""Soak: 2000 requests through an ``AsyncLLM`` with faults, aborts and bad input, all at random.

A tiny random Llama with n-gram speculation and a KV pool small enough to preempt; a driver keeps
about 32 streams in flight. Of the requests, some are bad (``ValueError`` at ``add_request``,
nothing queued), some are tied to an injected fault (their stream raises ``RequestError``), some
are aborted mid-stream (by ``abort`` or by cancelling the consuming task), and transient faults
fire at random steps. At the end: every healthy request's text equals a fault-free
``LLM.generate`` of the same prompt and parameters (greedy, or sampled with a seed), no stream
is left open, no request is left in the engine, and every KV block is free.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from tokenbudget import LLM, RequestError, SamplingParams
from tokenbudget.engine.entrypoints.async_llm import AsyncLLM
from tokenbudget.testing.faults import FaultInjectingRunner, FaultPlan

from engine_fixtures import assert_all_blocks_free  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow

NUM_REQUESTS = 2000
CONCURRENCY = 32
OPTS = dict(num_threads=1, kv_cache_memory_bytes=1 << 20, max_model_len=128,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3})
WORDS = ["abc", "hello", "world", "the", "cat", "sat", "on", "mat", "xyz", "abcabc", "12", "!"]
BAD = [(None, dict(max_tokens=0)), (None, dict(temperature=-1.0)), (None, dict(top_p=0.0)),
       (None, dict(seed=2**64)), (None, dict(top_k=-5)), ("x" * 400, {}), ([], {}), ([10**9], {})]


def _request(rng: random.Random, i: int):
    """(request_id, prompt, SamplingParams kwargs, fate). The last few are healthy, so the run
    never ends with only fault-tied requests in flight, which the engine rightly reads as an
    engine-wide fault (every request of a step failing alone)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    kw = dict(max_tokens=rng.randint(1, 16), ignore_eos=True)
    if rng.random() < 0.25:
        kw.update(temperature=0.8, seed=rng.randrange(2**32))
    else:
        kw.update(temperature=0.0)
    roll = rng.random()
    if i >= NUM_REQUESTS - 2 * CONCURRENCY:
        roll = 1.0
    fate = "bad" if roll < 0.05 else "poisoned" if roll < 0.08 else "abort" if roll < 0.18 else "healthy"
    return f"soak-{i}", prompt, kw, fate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("soak") / "tiny", layers=2, seed=3, scale=8.0)


def test_soak_faults_aborts_bad_input(model_dir) -> None:
    rng = random.Random(0)
    requests = [_request(rng, i) for i in range(NUM_REQUESTS)]
    healthy = [(rid, p, kw) for rid, p, kw, fate in requests if fate == "healthy"]
    reference_llm = LLM(model_dir, **OPTS)
    reference = {rid: (o.outputs[0].token_ids, o.outputs[0].text) for (rid, _, _), o in zip(
        healthy, reference_llm.generate([p for _, p, _ in healthy],
                                        [SamplingParams(**kw) for _, _, kw in healthy], use_tqdm=False))}

    async def main() -> dict:
        llm = AsyncLLM(model_dir, **OPTS)
        plan = FaultPlan()
        core = llm.engine.core
        core.runner = FaultInjectingRunner(core.runner, plan)
        results: dict[str, object] = {}
        slots = asyncio.Semaphore(CONCURRENCY)

        async def one(rid: str, prompt: str, kw: dict, fate: str) -> None:
            try:
                if fate == "bad":
                    bad_prompt, bad_kw = rng.choice(BAD)
                    with pytest.raises(ValueError):
                        llm.add_request(rid, prompt if bad_prompt is None else bad_prompt,
                                        SamplingParams(**{**kw, **bad_kw}))
                    results[rid] = "rejected"
                    return
                if fate == "poisoned":
                    plan.poisoned.add(rid)
                if rng.random() < 0.02:
                    plan.transient = 1
                stream = llm.add_request(rid, prompt, SamplingParams(**kw))
                first = asyncio.Event()

                async def consume() -> None:
                    async for out in stream:  # CUMULATIVE (the default): the text so far
                        first.set()
                        if out.finished:
                            results[rid] = (out.outputs[0].finish_reason, out.outputs[0].token_ids,
                                            out.outputs[0].text)

                consumer = asyncio.create_task(consume())
                if fate == "abort":
                    await asyncio.wait([consumer, asyncio.create_task(first.wait())],
                                       return_when=asyncio.FIRST_COMPLETED)
                    if rng.random() < 0.5:
                        llm.abort(rid)
                    else:
                        consumer.cancel()  # the consumer goes away: its stream aborts the request
                await consumer
            except RequestError as exc:
                results[rid] = ("error", str(exc))
            except asyncio.CancelledError:
                results[rid] = ("cancelled", "")
            finally:
                slots.release()

        tasks = []
        for req in requests:
            await slots.acquire()
            tasks.append(asyncio.create_task(one(*req)))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=900)
        await llm.shutdown()
        assert not llm._streams, f"{len(llm._streams)} streams left open"
        assert_all_blocks_free(llm.engine)
        assert llm.is_healthy()
        return results

    results = asyncio.run(main())
    assert len(results) == NUM_REQUESTS, "some requests never ended"
    for rid, _, _, fate in requests:
        got = results[rid]
        if fate == "healthy":
            assert got == ("length", *reference[rid]), rid
        elif fate == "poisoned":
            assert got[0] == "error" and "InjectedFault" in got[1], (rid, got)
        elif fate == "abort":
            assert got[0] in ("abort", "cancelled", "length"), (rid, got)  # it may finish first
        else:
            assert got == "rejected"
