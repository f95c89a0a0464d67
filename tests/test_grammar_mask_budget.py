"""The step's grammar-mask budget over the whole batch (issue 47: 62 children of a costly regex,
each within its own per-step budget, made every step of a neighbouring stream 100 times slower).

The planner (``MaskBudget``) over many cost patterns (Hypothesis): what it lets run fits the
budget or is one request, and nobody waits for ever. Then the engine through the real server,
with a budget so small that at most one structured request can have masks in a step: that is
what happens, they wait while a plain neighbour runs, and every answer is still right. Last,
admission: past ``max_grammar_mask_ms_in_flight`` a structured request is a 429.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget import AsyncLLM
from tokenbudget.engine.structured.mask_budget import MaskBudget

from engine_fixtures import StepGate  # noqa: E402
from serve_fixtures import KEY, running_server, wait_idle  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
COSTS = st.lists(st.floats(min_value=1e-5, max_value=0.02), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(COSTS, st.floats(min_value=1e-3, max_value=0.02), st.booleans())
def test_what_runs_fits_the_budget_and_every_request_runs_within_a_bound(costs, seconds, alone):
    """``alone``: no other request is in flight, so a step runs at least one; otherwise a step
    may run none (the masks take the budget on average)."""
    budget = MaskBudget(seconds)
    estimates = {f"r{i}": cost for i, cost in enumerate(costs)}
    share = seconds / len(costs)
    bound = len(costs) * (int(max(costs) / share) + 2)  # steps to earn one mask's credit, then a turn
    last_ran = dict.fromkeys(estimates, 0)
    for step in range(1, 2 * bound):
        waiting = budget.defer(estimates, alone)
        ran = [rid for rid in estimates if rid not in waiting]
        assert ran or not alone, "a step with only structured requests runs at least one"
        assert len(ran) <= 1 or sum(estimates[r] for r in ran) <= seconds * (1 + 1e-9)
        for rid in ran:
            budget.charge(rid, estimates[rid])
            last_ran[rid] = step
        assert all(step - last <= bound for last in last_ran.values())


def test_within_budget_nobody_waits():
    budget = MaskBudget(0.010)
    assert budget.defer({"a": 0.002, "b": 0.003, "c": 0.004}) == frozenset()


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> AsyncLLM:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=1, hidden=32, scale=25.0)
    # A budget no mask fits in: a step may compute the masks of one structured request only.
    return AsyncLLM(path, num_threads=1, kv_cache_memory_bytes=4 << 20, max_model_len=256,
                    max_batch_grammar_mask_ms=1e-6)


def test_at_most_one_structured_request_has_masks_in_a_step_and_answers_are_right(llm):
    core = llm.engine.core
    structured = core.structured
    steps: list[tuple[int, int, int]] = []  # (structured requests masked, rows scheduled, requests left out)
    original = structured.grammar_bitmask

    def spy(sched):
        masks = original(sched)
        steps.append((len(masks or {}), len(sched.scheduled), len(core._skip)))
        return masks

    structured.grammar_bitmask = spy
    greedy = {"prompt": "The quick brown fox", "max_tokens": 220, "temperature": 0, "ignore_eos": True}
    pattern = "^[ab]{5,12}$"
    costly = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "n": 6, "temperature": 1.0,
              "response_format": {"type": "json_schema", "json_schema": {
                  "name": "s", "schema": {"type": "string", "pattern": pattern}}}}
    out: dict[str, object] = {}
    try:
        with running_server(llm) as url:
            reference = httpx.post(f"{url}/v1/completions", json=greedy, headers=AUTH, timeout=60).json()
            grammar = threading.Thread(target=lambda: out.__setitem__("grammar", httpx.post(
                f"{url}/v1/chat/completions", json=costly, headers=AUTH, timeout=120)))
            text, started = [], False
            with httpx.stream("POST", f"{url}/v1/completions", json={**greedy, "stream": True}, headers=AUTH,
                              timeout=120) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: {"):
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                        if not started:
                            grammar.start()  # the neighbour streams: the structured children join it
                            started = True
            grammar.join(120)
            wait_idle(llm)
    finally:
        structured.grammar_bitmask = original
    out["neighbour"] = "".join(text)
    assert out["neighbour"] == reference["choices"][0]["text"]
    choices = out["grammar"].json()["choices"]
    assert len(choices) == 6 and all(re.fullmatch(pattern[1:-1], c["message"]["content"].strip('"'))
                                     for c in choices)
    assert max(masked for masked, _, _ in steps) == 1
    assert sum(1 for _, rows, left_out in steps if rows >= 1 and left_out) >= 10  # the neighbour ran, they waited


def test_structured_requests_past_the_grammar_load_in_flight_get_429(tmp_path):
    """While one structured request is in flight (steps held at a gate), a second one would
    take the masks in flight past ``max_grammar_mask_ms_in_flight``: 429 naming it; a plain
    request is admitted; once the first is done, structured requests are admitted again."""
    path = make_tiny_llama(tmp_path / "llama", layers=1, hidden=32, scale=25.0)
    llm = AsyncLLM(path, num_threads=1, kv_cache_memory_bytes=4 << 20, max_model_len=256,
                   max_grammar_mask_ms_in_flight=1e-6)
    structured = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "^[ab]{3}$"}}}}
    plain = {"prompt": "hi", "max_tokens": 2}
    first: list[httpx.Response] = []
    with running_server(llm) as url, StepGate(llm) as gate:
        thread = threading.Thread(target=lambda: first.append(
            httpx.post(f"{url}/v1/chat/completions", json=structured, headers=AUTH, timeout=60)))
        thread.start()
        gate.run_until(lambda: gate.parked)  # the first is in the engine; its step waits
        second = httpx.post(f"{url}/v1/chat/completions", json=structured, headers=AUTH, timeout=60)
        assert second.status_code == 429 and "max_grammar_mask_ms_in_flight" in second.json()["error"]["message"]
        other = threading.Thread(target=lambda: first.append(
            httpx.post(f"{url}/v1/completions", json=plain, headers=AUTH, timeout=60)))
        other.start()
        gate.open()
        thread.join(60)
        other.join(60)
        assert [r.status_code for r in first] == [200, 200]
        wait_idle(llm)
        assert httpx.post(f"{url}/v1/chat/completions", json=structured, headers=AUTH, timeout=60).status_code == 200
