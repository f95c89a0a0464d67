"""``AsyncLLM`` is bound to no event loop (Ray runs an actor's async UDF on a loop in another
thread than ``__init__``): built in one thread, it serves many concurrent ``generate`` calls from
loops in other threads, from two loops at once, and from a new loop after an old one closed with
a request still running (that request is aborted: nobody can read it). The texts are exactly
``LLM.generate``'s and the engine ends idle with every KV block free.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from tokenbudget import LLM, SamplingParams
from tokenbudget.engine.entrypoints.async_llm import AsyncLLM

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, default_target  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np", "Water boils at"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def async_llm() -> AsyncLLM:
    return AsyncLLM(default_target(), **ENGINE_OPTS)


@pytest.fixture(scope="module")
def reference(async_llm) -> list[str]:
    llm = LLM.__new__(LLM)  # an LLM front end over the same engine (no second model load)
    llm.engine, llm._ids = async_llm.engine, itertools.count()
    return [o.outputs[0].text for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


async def _text(llm: AsyncLLM, prompt: str, params: SamplingParams = PARAMS) -> str:
    async for out in llm.generate(prompt, params):  # CUMULATIVE: the last output has it all
        last = out
    return last.outputs[0].text


def _in_thread(fn):
    """Run ``fn()`` in a new thread; its result (or its exception, re-raised here)."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the loop thread hangs"
    if "error" in box:
        raise box["error"]
    return box["result"]


def _wait_idle(llm: AsyncLLM, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not llm.idle:
        assert time.monotonic() < deadline, "the step thread never went idle"
        time.sleep(0.01)
    assert_all_blocks_free(llm.engine)


def _run_all(llm: AsyncLLM, prompts: list[str]) -> list[str]:
    async def main():
        return await asyncio.wait_for(asyncio.gather(*(_text(llm, p) for p in prompts)), 90)
    return asyncio.run(main())


def test_many_concurrent_generates_on_a_loop_in_another_thread(async_llm, reference) -> None:
    texts = _in_thread(lambda: _run_all(async_llm, PROMPTS * 2))
    assert texts == reference * 2
    _wait_idle(async_llm)


def test_two_loops_at_once(async_llm, reference) -> None:
    results: list = [None, None]
    barrier = threading.Barrier(2)

    def side(i: int) -> None:
        barrier.wait()
        results[i] = _run_all(async_llm, PROMPTS[i::2])

    threads = [threading.Thread(target=side, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a loop hangs"
    assert results == [reference[0::2], reference[1::2]]
    _wait_idle(async_llm)


def test_a_new_loop_after_one_closed_mid_request(async_llm, reference) -> None:
    """Loop A reads the first output of a long request and is closed without finishing it; loop
    B (another thread) then generates normally, and A's orphan is aborted, not left running."""
    def abandon() -> None:
        loop = asyncio.new_event_loop()

        async def first_output():
            s = async_llm.add_request("orphan", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=400,
                                                                             ignore_eos=True))
            return await s.__anext__()

        first = loop.run_until_complete(first_output())
        assert not first.finished
        loop.close()  # the stream's loop is gone; its request still runs in the engine

    _in_thread(abandon)
    texts = _in_thread(lambda: _run_all(async_llm, PROMPTS[:3]))
    assert texts == reference[:3]
    _wait_idle(async_llm)
    assert "orphan" not in async_llm._streams


def test_requests_added_in_one_turn_of_the_loop_share_their_first_step(async_llm, reference) -> None:
    """The step thread waits for the turn that started it to end, so a burst of ``add_request``
    calls is one batch (an engine-wide fault then hits them together, as the engine's fault
    isolation expects), not a first step with the first request alone."""
    async def main():
        streams = [async_llm.add_request(f"burst-{i}", p, PARAMS) for i, p in enumerate(PROMPTS[:3])]
        return [[out async for out in s][-1] for s in streams]

    finals = asyncio.run(main())
    assert [o.outputs[0].text for o in finals] == reference[:3]
    assert len({o.metrics.first_scheduled_time for o in finals}) == 1
    _wait_idle(async_llm)
