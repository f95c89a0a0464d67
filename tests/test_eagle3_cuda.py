"""The EAGLE-3 drafter on a GPU (``cuda`` marker; skipped elsewhere): a bf16 tiny target with
head_dim 64 (FlashInfer's floor) and a random head, eager and under CUDA graphs, in deterministic
mode (the mode that promises greedy speculation the bits of plain decoding). Checks what the CPU
suite cannot: the head's forward, its KV and the target's taps on the device, the graph runner's
taps feeding the head, and the start-up probe that prices the head's drafts (it synchronizes)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from eagle3_fixtures import PROMPTS, greedy, random_head, token_ids, write_head
from tiny_llama import make_tiny_llama

HIDDEN = 256  # 4 heads of 64
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed"),
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_cuda")
    head = random_head(0, hidden_size=HIDDEN, target_hidden_size=HIDDEN, head_dim=64, intermediate_size=2 * HIDDEN)
    return {"target": make_tiny_llama(root / "target", layers=6, hidden=HIDDEN, seed=0, scale=8.0),
            "head": write_head(root / "head", head)}


def gpu_engine(target, spec=None, cuda_graphs=False):
    from tokenbudget.engine.entrypoints.llm import LLM
    return LLM(str(target), device="cuda", dtype="bfloat16", deterministic=True, cuda_graphs=cuda_graphs,
               kv_cache_memory_bytes=64 << 20, max_num_seqs=8, speculative_config=spec)


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_eagle3_on_the_gpu_equals_plain_decoding(dirs, cuda_graphs, k) -> None:
    params = greedy(32)
    plain = token_ids(gpu_engine(dirs["target"], cuda_graphs=cuda_graphs), PROMPTS, params)
    llm = gpu_engine(dirs["target"], {"method": "eagle3", "model": dirs["head"], "num_speculative_tokens": k},
                     cuda_graphs=cuda_graphs)
    assert llm.engine.core.runner.attn_backend.name == "flashinfer"
    if k == "auto":  # the start-up probe priced the head's drafts on the device
        per_request, per_row = llm.engine.speculator.controller.cost_model.drafter_weights
        assert per_request + per_row > 0
    assert token_ids(llm, PROMPTS, params) == plain
    proposer = llm.engine.speculator.proposer
    assert proposer.device.type == "cuda" and proposer.cpu_forward is None
    if k == 3:  # under "auto" the priced head may rightly never draft: on this tiny target a head
        # step costs about what a target step does (H200: the controller drafted nothing)
        assert proposer.num_catchup_tokens > 0 and proposer.num_draft_forward_tokens > 0
        assert llm.get_spec_stats().num_draft_tokens > 0
    assert proposer.num_tracked_requests == 0
    llm.engine.core.scheduler.check_integrity()
