"""The OpenAI server's ``priority`` field (vLLM's) feeds the scheduler's priority policy.

One seat (``max_num_seqs=1``), ``--scheduling-policy priority``: a long low-priority stream is
running when an urgent request arrives; the urgent one takes the seat (the long one is
preempted, then resumes) and finishes while the long stream is still going, and the long
stream's text equals the offline engine's (preemption changes no output). A server that
schedules first come, first served refuses a non-zero priority (400 naming the field).
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

pytest.importorskip("fastapi")

from tokenbudget import LLM, AsyncLLM, SamplingParams  # noqa: E402

from engine_fixtures import ENGINE_OPTS, default_target  # noqa: E402
from serve_fixtures import KEY, MODEL, running_server, wait_idle  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = dict(model=MODEL, prompt="Once upon a time,", max_tokens=120, temperature=0, ignore_eos=True)


def test_an_urgent_request_takes_the_only_seat():
    llm = AsyncLLM(default_target(), **{**ENGINE_OPTS, "max_num_seqs": 1, "scheduling_policy": "priority"})
    with running_server(llm) as url:
        urgent_done = threading.Event()
        tokens_after_urgent = []
        text = []

        def stream_long():
            with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=300,
                              json={**LONG, "stream": True, "priority": 5}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])["choices"][0]["text"]
                    text.append(chunk)
                    if len(text) == 3:
                        started.set()
                    if urgent_done.is_set():
                        tokens_after_urgent.append(chunk)

        started = threading.Event()
        long = threading.Thread(target=stream_long)
        long.start()
        assert started.wait(120)
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120,
                       json=dict(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                 priority=-1))
        urgent_done.set()
        assert r.status_code == 200, r.text
        long.join(300)
        assert tokens_after_urgent, "the urgent request waited for the whole long one"
        assert llm.get_stats().num_preemptions_total >= 1
        offline = LLM(default_target(), **ENGINE_OPTS)
        want = offline.generate(LONG["prompt"], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
        assert "".join(text) == want[0].outputs[0].text
        wait_idle(llm)


def test_fcfs_server_refuses_a_priority():
    llm = AsyncLLM(default_target(), **ENGINE_OPTS)
    with running_server(llm) as url:
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                       json=dict(model=MODEL, prompt="Hi", max_tokens=2, priority=3))
        assert r.status_code == 400 and "priority" in r.text
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                       json=dict(model=MODEL, prompt="Hi", max_tokens=2, priority=0))
        assert r.status_code == 200
