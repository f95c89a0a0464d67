"""``AsyncLLM`` on the real default model: concurrent streams, cancellation, bad requests.

Cancelling a stream (leaving its ``async for`` early, or cancelling the task that iterates it)
aborts the request; the other streams finish with exactly the text ``LLM.generate`` gives, and
afterwards the engine is idle with every KV block free.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tokenbudget import LLM, SamplingParams
from tokenbudget.engine.entrypoints.async_llm import AsyncLLM

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, default_target  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def async_llm() -> AsyncLLM:
    return AsyncLLM(default_target(), **ENGINE_OPTS)


@pytest.fixture(scope="module")
def reference(async_llm) -> list[str]:
    """What ``LLM.generate`` gives for each prompt, on the same engine (no loop running yet)."""
    llm = LLM.__new__(LLM)  # an LLM front end over the AsyncLLM's engine (no second model load)
    llm.engine, llm._ids = async_llm.engine, itertools.count()
    return [o.outputs[0].text for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


async def _wait_idle(llm: AsyncLLM, timeout: float = 60.0) -> None:
    """Queued aborts are applied by the background loop; wait until it has drained."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not llm.idle or llm.engine.has_unfinished_requests():
        assert asyncio.get_running_loop().time() < deadline, "engine never became idle"
        await asyncio.sleep(0.01)


async def _collect(llm: AsyncLLM, prompt: str, rid: str) -> list:
    return [out async for out in llm.generate(prompt, PARAMS, request_id=rid)]


def test_concurrent_streams_with_cancellations(async_llm, reference) -> None:
    """The cancelled consumer parks inside its ``async for`` after two outputs and is cancelled
    there: its request cannot run to the end first, however fast the engine."""
    seen_cancelled_task: list = []
    reached = asyncio.Event()

    async def breaks_early() -> int:
        n = 0
        async for out in async_llm.generate(PROMPTS[2], PARAMS, request_id="breaks"):
            n += 1
            if n == 3:
                assert not out.finished
                break
        return n

    async def cancelled_task() -> None:
        async for out in async_llm.generate(PROMPTS[3], PARAMS, request_id="cancelled"):
            seen_cancelled_task.append(out)
            if len(seen_cancelled_task) == 2:
                reached.set()
                await asyncio.sleep(3600)  # cancelled here, mid-stream

    async def main():
        a = asyncio.create_task(_collect(async_llm, PROMPTS[0], "a"))
        b = asyncio.create_task(_collect(async_llm, PROMPTS[1], "b"))
        c = asyncio.create_task(breaks_early())
        d = asyncio.create_task(cancelled_task())
        await asyncio.wait_for(reached.wait(), timeout=60)
        d.cancel()
        with pytest.raises(asyncio.CancelledError):
            await d
        outs_a, outs_b, n_c = await asyncio.gather(a, b, c)
        await _wait_idle(async_llm)
        return outs_a, outs_b, n_c

    outs_a, outs_b, n_c = asyncio.run(main())
    assert n_c == 3
    assert len(seen_cancelled_task) == 2 and not seen_cancelled_task[-1].finished
    for outs, ref in ((outs_a, reference[0]), (outs_b, reference[1])):
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].text == ref
        assert len(outs[-1].outputs[0].token_ids) == PARAMS.max_tokens
        texts = [o.outputs[0].text for o in outs]  # streamed text only grows
        assert all(ref.startswith(t) for t in texts)
    assert not async_llm._streams and not async_llm._pending_aborts
    assert not async_llm.engine.core.outputs.states
    assert_all_blocks_free(async_llm.engine)


def test_bad_request_raises_from_iterator(async_llm, reference) -> None:
    async def main():
        with pytest.raises(ValueError, match="empty"):
            async for _ in async_llm.generate("", PARAMS):
                pass
        too_long = [1] * (async_llm.engine.max_model_len + 1)
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in async_llm.generate(too_long, PARAMS):
                pass
        # A duplicate id fails while the first is in flight, and the first is undisturbed.
        first = async_llm.generate(PROMPTS[0], PARAMS, request_id="dup")
        head = await first.__anext__()
        with pytest.raises(ValueError, match="duplicate"):
            async for _ in async_llm.generate(PROMPTS[1], PARAMS, request_id="dup"):
                pass
        rest = [out async for out in first]
        await _wait_idle(async_llm)
        return head, rest

    head, rest = asyncio.run(main())
    assert not head.finished and rest[-1].finished
    assert rest[-1].outputs[0].text == reference[0]
    assert not async_llm._streams
    assert_all_blocks_free(async_llm.engine)


def test_add_request_validates_at_once_and_abort_ends_the_stream(async_llm, reference) -> None:
    """``add_request`` raises before anything streams; ``abort`` ends a stream that is being read
    with a final "abort" output (it never hangs); the other stream is undisturbed."""
    async def main():
        with pytest.raises(ValueError, match="out of range"):
            async_llm.add_request("bad", [1, 10**9], PARAMS)
        with pytest.raises(ValueError, match="empty"):
            async_llm.add_request("bad", "", PARAMS)
        assert "bad" not in async_llm._streams
        keep = async_llm.add_request("keep", PROMPTS[0], PARAMS)
        doomed = async_llm.add_request("doomed", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=400,
                                                                             ignore_eos=True))
        first = await doomed.__anext__()
        async_llm.abort("doomed")
        rest = [out async for out in doomed]
        kept = [out async for out in keep]
        await _wait_idle(async_llm)
        return first, rest, kept

    first, rest, kept = asyncio.run(main())
    assert not first.finished and len(rest) == 1 and rest[0].finished
    assert rest[0].outputs[0].finish_reason == "abort"
    assert kept[-1].outputs[0].text == reference[0]
    assert not async_llm._streams
    assert_all_blocks_free(async_llm.engine)
