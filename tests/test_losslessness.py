"""docs/DESIGN.md invariant 8 as a property: whatever the drafts, acceptance pattern, chunking,
preemptions, arrival order and aborts, every completed request's token stream equals its solo,
draft-free reference run (fake deterministic model over the real paged KV cache)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenbudget.testing.fake_model import FakeModelSpec
from tokenbudget.testing.harness import Harness
from tokenbudget.testing.strategies import scheduler_configs

from engine_fixtures import bounded

SPEC = FakeModelSpec()
PREFIXES = [[], [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57], [7] * 9 + [3] * 5]


@st.composite
def workloads(draw):
    config = draw(scheduler_configs())
    max_prompt = max(1, config.max_model_len // 2)
    requests = []
    for i in range(draw(st.integers(1, 14))):
        prefix = PREFIXES[draw(st.sampled_from([0, 1, 1, 2]))]
        prompt = (prefix + draw(st.lists(st.integers(1, SPEC.vocab_size - 1), min_size=1, max_size=max_prompt)))
        prompt = prompt[:config.max_model_len]
        max_tokens = draw(st.integers(1, 48))
        # Keep it admissible: the longest it can get (plus lookahead) must fit the whole pool.
        while max_tokens > 1 and -(-min(len(prompt) + max_tokens + config.num_lookahead_tokens,
                                        config.max_model_len) // config.block_size) > config.num_blocks:
            max_tokens -= 1
        requests.append(dict(rid=f"r{i}", prompt=prompt, max_tokens=max_tokens,
                             arrival=draw(st.integers(0, 25)), priority=draw(st.integers(-2, 2)),
                             ignore_eos=draw(st.booleans()),
                             stop=frozenset(draw(st.lists(st.integers(1, SPEC.vocab_size - 1), max_size=1)))))
    drafts = draw(st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 5, 8]),
                                     st.sampled_from([0.0, 0.3, 0.7, 0.95, 1.0])), min_size=1, max_size=30))
    aborts = draw(st.lists(st.tuples(st.integers(0, len(requests) - 1), st.integers(0, 40)), max_size=3))
    return config, requests, drafts, aborts, draw(st.integers(0, 2**16))


def _fits(config, r) -> bool:
    need = -(-min(len(r["prompt"]) + r["max_tokens"] + config.num_lookahead_tokens, config.max_model_len)
             // config.block_size)
    return need <= config.num_blocks


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_outputs_equal_solo_reference(workload):
    config, requests, drafts, aborts, seed = workload
    h = Harness(config, SPEC, seed=seed)
    pending = sorted((r for r in requests if _fits(config, r)), key=lambda r: r["arrival"])
    abort_at: dict[int, list[str]] = {}
    for idx, step in aborts:
        abort_at.setdefault(step, []).append(requests[idx]["rid"])
    step = 0
    for _ in bounded(lambda: pending or h.scheduler.has_unfinished_requests()):
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            h.add(h.make_request(r["rid"], r["prompt"], max_tokens=r["max_tokens"], priority=r["priority"],
                                 ignore_eos=r["ignore_eos"], stop_token_ids=r["stop"]))
        for rid in abort_at.get(step, []):
            h.abort(rid)
        k, p_correct = drafts[step % len(drafts)]
        h.step(k, p_correct)
        step += 1
        assert step < 20_000, "workload did not drain"
    h.check_lossless()
    completed = [rid for rid, why in h.finished.items() if why != "abort"]
    assert set(h.finished) == set(h.submitted)
    for rid in completed:  # spelled out once more: non-aborted output == reference alone
        assert h.outputs[rid] == h.expected(rid)
    kv = h.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
