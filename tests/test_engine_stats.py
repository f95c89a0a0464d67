"""Engine-side serving figures on the default model: per-request timestamps (queue time, TTFT,
TPOT, e2e) in ``RequestOutput.metrics``, ``get_stats()``, admission control."""

from __future__ import annotations

import asyncio

import pytest

from tokenbudget import AsyncLLM, EngineConfig, EngineOverloadedError, LLMEngine, SamplingParams

from engine_fixtures import ENGINE_OPTS, StepGate, bounded, default_target  # noqa: E402

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_timestamps_are_ordered_and_intervals_consistent():
    engine = LLMEngine(model=default_target(), **ENGINE_OPTS)
    engine.add_request("a", "The capital of France is", PARAMS)
    engine.add_request("b", "Once upon a time", PARAMS)
    final = {}
    for _ in bounded(engine.has_unfinished_requests):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    for out in final.values():
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.num_output_tokens == 6
        assert m.queue_time >= 0 and m.time_to_first_token >= m.queue_time
        assert m.time_per_output_token == pytest.approx((m.last_token_time - m.first_token_time) / 5)
        assert m.e2e_latency >= m.time_to_first_token
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
    assert stats.num_generation_tokens_total == 12 and stats.healthy
    assert stats.num_prompt_tokens_total == sum(len(o.prompt_token_ids) for o in final.values())


def test_llm_engine_admission_control():
    engine = LLMEngine(model=default_target(), **ENGINE_OPTS, max_queued_requests=2, max_queued_tokens=10_000)
    engine.add_request("a", "Hello", PARAMS)
    engine.add_request("b", "Hello", PARAMS)
    with pytest.raises(EngineOverloadedError, match="max_queued_requests"):
        engine.add_request("c", "Hello", PARAMS)
    assert engine.get_stats().num_waiting == 2  # the refused one changed nothing
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    engine.add_request("c", "Hello", PARAMS)  # room again


def test_admission_counts_the_children_of_n():
    """An n=4 request queues four requests (and four prompts' tokens): once counted as one."""
    engine = LLMEngine(model=default_target(), **ENGINE_OPTS, max_queued_requests=4)
    engine.add_request("one", "Hello", PARAMS)
    with pytest.raises(EngineOverloadedError, match="adds 4"):
        engine.add_request("four", "Hello", SamplingParams(n=4, temperature=1.0, max_tokens=6))
    engine.add_request("three", "Hello", SamplingParams(n=3, temperature=1.0, max_tokens=6))  # 1 + 3 fits
    assert engine.get_stats().num_waiting == 4
    tokens = LLMEngine(model=default_target(), **ENGINE_OPTS, max_queued_tokens=10)
    tokens.add_request("one", "Hello", PARAMS)
    with pytest.raises(EngineOverloadedError, match="max_queued_tokens"):  # 1 + 4 x 3 tokens > 10
        tokens.add_request("four", "Hello there you", SamplingParams(n=4, temperature=1.0, max_tokens=6))
    lone = LLMEngine(model=default_target(), **ENGINE_OPTS, max_queued_requests=2)
    lone.add_request("alone", "Hello", SamplingParams(n=8, temperature=1.0, max_tokens=6))  # waits alone: admitted


def test_max_queued_tokens_refuses_but_never_a_lone_request():
    engine = LLMEngine(model=default_target(), **ENGINE_OPTS, max_queued_tokens=3)
    engine.add_request("long", "one two three four five six seven", PARAMS)  # alone: admitted
    with pytest.raises(EngineOverloadedError, match="max_queued_tokens"):
        engine.add_request("more", "Hello", PARAMS)


@pytest.mark.parametrize("name", ["max_queued_requests", "max_queued_tokens"])
def test_bad_admission_options_name_the_field(name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: 0})


def test_async_llm_stats_snapshot_and_admission():
    """A gate lets exactly one engine step run, so "a" is running (not finished) when the
    snapshot is read, whatever the machine's speed."""
    async def main():
        llm = AsyncLLM(default_target(), **dict(ENGINE_OPTS, max_num_seqs=1), max_queued_requests=1)
        with StepGate(llm) as gate:
            first = llm.add_request("a", "Hello", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
            gate.grant(1)
            await asyncio.wait_for(first.__anext__(), timeout=60)  # "a" runs; the next step waits at the gate
            llm.add_request("b", "Hello", PARAMS)  # waits (max_num_seqs=1)
            with pytest.raises(EngineOverloadedError):
                llm.add_request("c", "Hello", PARAMS)
            stats = llm.get_stats()
            assert stats.num_running == 1 and stats.num_waiting == 0 and stats.kv_blocks_used > 0
            gate.open()
        await llm.shutdown()
        stats = llm.get_stats()
        assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
    asyncio.run(main())
