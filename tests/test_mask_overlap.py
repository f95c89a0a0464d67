"""Grammar masks computed beside the forward pass (``engine.structured.mask_overlap``).

On the default model with ngram speculation (verify rows masked through the drafts): the masks
of a step are computed on the mask thread while the forward runs (proved with two events: the
mask computation waits until the forward has begun, and the forward until the masks have begun;
computed one after the other, one of them would wait in vain), and the outputs are exactly those
of masks computed before the forward. A mask fault that arrives after the forward (the request's
own) ends that request alone, the others' outputs unchanged, and leaves no block or grammar state
behind; a forward that fails while the masks are being computed rolls back only after the mask
thread is done.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from tokenbudget import LLM, SamplingParams, StructuredOutputsParams
from tokenbudget.scheduler.request_fault import RequestFault

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, default_target  # noqa: E402

PROMPTS = ["Give a phone number like 555-1234 and nothing else:", "A date as YYYY-MM-DD:",
           "List three fruits, comma separated:"]
PATTERNS = [r"[0-9]{3}-[0-9]{4}", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r"[a-z]+(, [a-z]+){2}"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(default_target(), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **ENGINE_OPTS)


def _params(max_tokens: int = 16) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(regex=p))
            for p in PATTERNS] + [SamplingParams(temperature=0, max_tokens=max_tokens)]


def _run(llm: LLM):
    outs = llm.generate(PROMPTS + ["The capital of France is"], _params(), use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    assert not llm.engine.core.structured.matchers
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _before_the_forward(llm: LLM, monkeypatch) -> list:
    with monkeypatch.context() as m:
        m.setattr(llm.engine.core.masks, "_fits", lambda sched: False)
        return _run(llm)


def test_masks_run_beside_the_forward_and_change_no_token(llm, monkeypatch):
    want = _before_the_forward(llm, monkeypatch)
    core = llm.engine.core
    structured, runner = core.structured, core.runner
    masks_begun, forward_begun = threading.Event(), threading.Event()
    met = {"masks": 0, "forward": 0, "steps": 0}
    real_masks, real_forward = structured.grammar_bitmask, runner._forward

    def masks(sched):
        masks_begun.set()
        met["masks"] += forward_begun.wait(10)
        return real_masks(sched)

    def forward(sched):
        forward_begun.set()
        if not isinstance(sched.grammar_bitmask, Future):
            return real_forward(sched)  # masks made before (none, or the step did not fit)
        met["forward"] += masks_begun.wait(10)
        met["steps"] += 1
        try:
            return real_forward(sched)
        finally:
            masks_begun.clear()
            forward_begun.clear()

    monkeypatch.setattr(structured, "grammar_bitmask", masks)
    monkeypatch.setattr(runner, "_forward", forward)
    beside = core.masks.steps_beside
    assert _run(llm) == want
    assert core.masks.steps_beside > beside and met["steps"] > 0
    assert met["forward"] == met["steps"] and met["masks"] >= met["steps"]  # each saw the other begin


def test_a_mask_fault_after_the_forward_ends_its_request_alone(llm, monkeypatch):
    want = _before_the_forward(llm, monkeypatch)
    core = llm.engine.core
    structured = core.structured
    real = structured.grammar_bitmask
    faults = {"n": 0}
    on_thread = []

    def faulty(sched):
        on_thread.append(threading.current_thread().name)
        victim = next((sr.request_id for sr in sched.scheduled if sr.request_id in structured.matchers
                       and sr.num_computed_tokens > 0), None)
        if victim is not None and not faults["n"] and threading.current_thread().name.startswith("tokenbudget-masks"):
            faults["n"] += 1
            raise RequestFault({victim: "structured_outputs: an injected mask fault"})
        return real(sched)

    monkeypatch.setattr(structured, "grammar_bitmask", faulty)
    got = _run(llm)
    assert faults["n"] == 1
    failed = [i for i, (_, reason) in enumerate(got) if reason == "error"]
    assert len(failed) == 1 and failed[0] < len(PATTERNS)
    assert [g for i, g in enumerate(got) if i not in failed] == [w for i, w in enumerate(want) if i not in failed]
    llm.engine.core.scheduler.check_integrity()


def test_a_forward_fault_waits_for_the_mask_thread_before_rolling_back(llm, monkeypatch):
    want = _before_the_forward(llm, monkeypatch)
    core = llm.engine.core
    structured, runner = core.structured, core.runner
    real_masks, real_forward = structured.grammar_bitmask, runner._forward
    release, masks_begun = threading.Event(), threading.Event()
    state = {"in_masks": False, "rolled_back_during_masks": False, "faults": 0}
    real_rollback = structured.rollback

    def slow_masks(sched):
        state["in_masks"] = True
        masks_begun.set()
        try:
            release.wait(0.2)  # still computing when the forward fails
            return real_masks(sched)
        finally:
            state["in_masks"] = False

    def failing_forward(sched):
        if isinstance(sched.grammar_bitmask, Future) and state["faults"] < 2:
            state["faults"] += 1
            masks_begun.wait(10)
            masks_begun.clear()
            raise RuntimeError("injected forward fault")
        return real_forward(sched)

    def rollback():
        state["rolled_back_during_masks"] |= state["in_masks"]
        return real_rollback()

    monkeypatch.setattr(structured, "grammar_bitmask", slow_masks)
    monkeypatch.setattr(runner, "_forward", failing_forward)
    monkeypatch.setattr(structured, "rollback", rollback)
    assert _run(llm) == want
    assert state["faults"] == 2 and not state["rolled_back_during_masks"]
