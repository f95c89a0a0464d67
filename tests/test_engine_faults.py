"""Faults inside a step, on the real default model: the EngineCore's promises end to end.

A fault injected into the runner or the proposer (``testing.faults``) must be invisible
when transient, end only the request it is tied to (``finish_reason="error"``), leave the engine
usable after Ctrl-C, and kill the engine cleanly when it is engine-wide. In every case the other
requests' greedy tokens are exactly those of a fault-free run, and no KV block stays held.
"""

from __future__ import annotations

import asyncio

import pytest

from tokenbudget import LLM, EngineDeadError, RequestError, RequestOutputKind, SamplingParams
from tokenbudget.engine.entrypoints.async_llm import AsyncLLM
from tokenbudget.testing.faults import FaultInjectingProposer, FaultInjectingRunner, FaultPlan

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, bounded, default_target  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(default_target(), **ENGINE_OPTS)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def plan(llm):
    """A fault plan on ``llm``'s runner for one test; the plain runner is put back after it."""
    core = llm.llm_engine.core
    inner, faults = core.runner, FaultPlan()
    core.runner = FaultInjectingRunner(inner, faults)
    yield faults
    core.runner = inner
    assert_all_blocks_free(llm.llm_engine)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("late", [False, True], ids=["before-forward", "after-forward"])
def test_transient_fault_is_invisible(llm, reference, plan, late) -> None:
    plan.transient, plan.late = 1, late
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert plan.num_fired == 1 and llm.llm_engine.core.num_failed_attempts >= 1


def test_malformed_runner_output_is_caught_and_retried(llm, reference, plan) -> None:
    plan.malformed = True
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert plan.num_fired == 1


def test_fault_tied_to_one_request_ends_only_it(llm, reference, plan) -> None:
    engine = llm.llm_engine
    ids = [f"tied-{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS):
        engine.add_request(rid, prompt, GREEDY)
    plan.poisoned.add(ids[1])
    plan.late = True  # after the forward wrote its KV: the rollback must not trust those blocks
    final = {}
    for _ in bounded(engine.has_unfinished_requests):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.scheduler.check_integrity()
    bad = final.pop(ids[1])
    assert bad.outputs[0].finish_reason == "error" and "InjectedFault" in bad.error
    assert {rid: o.outputs[0].token_ids for rid, o in final.items()} == {
        rid: ref for rid, ref in zip(ids, reference) if rid != ids[1]}
    assert all(o.outputs[0].finish_reason == "length" for o in final.values())


def test_keyboard_interrupt_leaves_the_llm_usable(llm, reference, plan) -> None:
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # warm: the interrupt lands mid-run below
    plan.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm.llm_engine)  # generate aborted its requests
    assert llm.llm_engine.is_healthy()
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_proposer_fault_under_ngram_ends_only_its_request(reference) -> None:
    llm = LLM(default_target(), speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              **ENGINE_OPTS)
    engine = llm.llm_engine
    speculator = engine.core.speculator
    faults = FaultPlan(poisoned={"p-0"})
    speculator.proposer = FaultInjectingProposer(speculator.proposer, faults)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"p-{i}", prompt, GREEDY)
    final = {}
    for _ in bounded(engine.has_unfinished_requests):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["p-0"].outputs[0].finish_reason == "error" and faults.num_fired >= 2
    assert [final[f"p-{i}"].outputs[0].token_ids for i in range(1, len(PROMPTS))] == reference[1:]
    assert_all_blocks_free(engine)


def test_engine_wide_fault_kills_the_engine_cleanly() -> None:
    llm = LLM(default_target(), **ENGINE_OPTS)
    core = llm.llm_engine.core
    core.runner = FaultInjectingRunner(core.runner, FaultPlan(engine_wide=True))
    with pytest.raises(EngineDeadError) as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert "InjectedFault" in str(info.value)
    assert not llm.llm_engine.is_healthy()
    assert_all_blocks_free(llm.llm_engine)
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


# ---------------------------------------------------------------- AsyncLLM


async def _drain(stream) -> list[int]:
    tokens = []
    async for out in stream:
        tokens.extend(out.outputs[0].token_ids)
    return tokens


def test_async_fault_tied_to_one_stream(reference) -> None:
    async def main() -> None:
        llm = AsyncLLM(default_target(), **ENGINE_OPTS)
        core = llm.engine.core
        core.runner = FaultInjectingRunner(core.runner, FaultPlan(poisoned={"s-2"}))
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        streams = [llm.add_request(f"s-{i}", p, params) for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*(_drain(s) for s in streams), return_exceptions=True)
        assert isinstance(results[2], RequestError) and results[2].request_id == "s-2"
        assert [r for i, r in enumerate(results) if i != 2] == [ref for i, ref in enumerate(reference) if i != 2]
        assert llm.is_healthy()
        await llm.shutdown()
        assert_all_blocks_free(llm.engine)

    asyncio.run(main())


def test_async_engine_death_reaches_every_stream() -> None:
    async def main() -> None:
        llm = AsyncLLM(default_target(), **ENGINE_OPTS)
        core = llm.engine.core
        core.runner = FaultInjectingRunner(core.runner, FaultPlan(engine_wide=True))
        streams = [llm.add_request(None, p, GREEDY) for p in PROMPTS]
        results = await asyncio.gather(*(_drain(s) for s in streams), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert not llm.is_healthy()
        with pytest.raises(EngineDeadError):
            llm.add_request(None, PROMPTS[0], GREEDY)
        assert_all_blocks_free(llm.engine)

    asyncio.run(main())


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_unread_stream_coalesces_into_one_output(reference, kind) -> None:
    """A consumer that reads nothing until the end gets one output holding everything: the stream
    buffers pieces, not a copy of the whole output per step."""
    async def main() -> None:
        llm = AsyncLLM(default_target(), **ENGINE_OPTS)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=kind)
        stream = llm.add_request("slow-reader", PROMPTS[0], params)
        deadline = asyncio.get_running_loop().time() + 60
        while not stream.finished:
            assert asyncio.get_running_loop().time() < deadline, "the stream never finished"
            await asyncio.sleep(0.01)
        outs = [out async for out in stream]
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].outputs[0].token_ids == reference[0]
        await llm.shutdown()

    asyncio.run(main())
