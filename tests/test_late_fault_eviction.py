"""A step that fails after its forward pass must not give evicted blocks their prefix-cache
hashes back (issue 43's wrong-token survivor; the rule: ``kv_cache.journal``).

The scenario, on a tiny random Llama with a 12-block pool: A runs and leaves its prompt's blocks in
the prefix cache; B's prompt needs more blocks than were never used, so the pool evicts A's last
blocks and hands them to B; B's step fails after the forward has written B's KV into them (a late
fault caused by B, twice, so B ends alone). Had the rollback restored those blocks' hashes, C (A's
prompt again) would hit them and attend to B's keys and values: it decodes other tokens than A
did (measured with the rule broken: ``[169, 148, 188, 243]`` for ``[45, 140, 187, 187]``).

Checked twice: through the outputs (C equals A), and by ``TransactionChecker``, whose rollback
fingerprint requires that a block the failed attempt handed out has no hash after a rollback
that followed a forward.
"""

from __future__ import annotations

import pytest

from tokenbudget import LLM, SamplingParams
from tokenbudget.testing.faults import FaultInjectingRunner, FaultPlan
from tokenbudget.testing.fingerprint import TransactionChecker

from engine_fixtures import assert_all_blocks_free  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

A = {"prompt_token_ids": [(7 * i) % 90 + 3 for i in range(70)]}  # 4 full blocks + a partial one
B = {"prompt_token_ids": [(11 * i) % 90 + 5 for i in range(150)]}  # 10 blocks: 7 never used + 3 of A's
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=1, hidden=32, scale=25.0)


def _scenario(tiny_dir: str, check_rollbacks: bool):
    llm = LLM(tiny_dir, num_threads=1, kv_cache_memory_bytes=24 << 10, max_model_len=256)
    core, engine = llm.engine.core, llm.engine
    pool = core.scheduler.kv.pool
    assert len(pool.blocks) == 12, "the scenario's block counts assume a 12-block pool"
    alone = llm.generate([A], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    cached = len(pool.cached)
    assert cached == 4  # A's full prompt blocks

    plan = FaultPlan(late=True, poisoned={"B"})
    core.runner = FaultInjectingRunner(core.runner, plan)
    checker = TransactionChecker(core) if check_rollbacks else None
    engine.add_request("B", B, GREEDY)
    finished = []
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        finished += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finished] == [("B", "error")]
    assert plan.num_fired >= 2
    evicted = pool.num_evictions > 0 and len(pool.cached) < cached  # B's attempts evicted A's tail
    plan.poisoned = set()
    again = llm.generate([A], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_all_blocks_free(engine)
    return alone, again, checker, evicted


def test_a_late_fault_that_evicted_cached_blocks_leaves_no_wrong_prefix_hit(tiny_dir):
    alone, again, _, evicted = _scenario(tiny_dir, check_rollbacks=False)
    assert again == alone
    assert evicted, "the scenario no longer evicts A's blocks: it tests nothing"


def test_the_rollback_fingerprint_requires_handed_out_blocks_to_lose_their_hash(tiny_dir):
    _, _, checker, _ = _scenario(tiny_dir, check_rollbacks=True)  # a RollbackMismatch would raise out of step()
    assert checker.num_checked >= 2
