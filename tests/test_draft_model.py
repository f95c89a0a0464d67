"""Model drafters (spec.draft_model): draft_model and self_draft on tiny random Llama models.

Target and drafter share a byte-level vocabulary (259 ids: 256 bytes + 3 specials), written as
HF directories (``save_pretrained`` + tokenizer.json) the way tests/test_loader.py builds them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.entrypoints.llm import LLM

from tiny_llama import VOCAB, make_tiny_llama, make_truncated_copy  # noqa: E402

PROMPTS = ["hello world, hello world, hello", "abcabcabcabc", "The quick brown fox",
           "x" * 40 + " then some more text to make this prompt a good deal longer than the others"]


def make_engine(path, spec=None, **opts) -> LLM:
    opts.setdefault("kv_cache_memory_bytes", 4 << 20)
    opts.setdefault("num_threads", 1)
    return LLM(str(path), speculative_config=spec, **opts)


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_llama(root / "target", layers=4, seed=0, scale=8.0)
    draft = make_truncated_copy(target, root / "draft", layers=3)
    small = make_tiny_llama(root / "small", layers=1, hidden=32, seed=1, scale=8.0)
    other = make_tiny_llama(root / "other_vocab", layers=1, hidden=32, vocab=300, seed=2)
    return {"target": target, "draft": draft, "small": small, "other": other}


@pytest.fixture(scope="module")
def baseline(tiny_dirs):
    return token_ids(make_engine(tiny_dirs["target"]), PROMPTS, greedy())


def test_draft_model_greedy_equals_no_spec(tiny_dirs, baseline) -> None:
    llm = make_engine(tiny_dirs["target"], {"method": "draft_model", "model": tiny_dirs["draft"],
                                            "num_speculative_tokens": 3})
    assert token_ids(llm, PROMPTS, greedy()) == baseline
    stats = llm.get_spec_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both verify outcomes seen
    proposer = llm.engine.speculator.proposer
    assert proposer.num_tracked_requests == 0  # state dropped when requests finish


def test_identical_drafter_accepts_everything(tiny_dirs, baseline) -> None:
    llm = make_engine(tiny_dirs["target"], {"method": "draft_model", "model": tiny_dirs["target"],
                                            "num_speculative_tokens": 4})
    assert token_ids(llm, PROMPTS, greedy()) == baseline
    stats = llm.get_spec_stats()
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate == 1.0


def test_self_draft_all_layers_accepts_everything(tiny_dirs, baseline) -> None:
    llm = make_engine(tiny_dirs["target"], {"method": "self_draft", "draft_num_layers": 4,
                                            "num_speculative_tokens": 4})
    assert token_ids(llm, PROMPTS, greedy()) == baseline
    assert llm.get_spec_stats().acceptance_rate == 1.0


def test_self_draft_greedy_equals_no_spec(tiny_dirs, baseline) -> None:
    llm = make_engine(tiny_dirs["target"], {"method": "self_draft", "draft_num_layers": 2,
                                            "num_speculative_tokens": 3})
    assert token_ids(llm, PROMPTS, greedy()) == baseline
    assert llm.get_spec_stats().num_draft_tokens > 0


def test_self_draft_shares_weights_and_matches_first_layers(tiny_dirs) -> None:
    llm = make_engine(tiny_dirs["target"], {"method": "self_draft", "draft_num_layers": 2,
                                            "num_speculative_tokens": 2})
    target = llm.engine.target.model
    runner = llm.engine.speculator.proposer.runner
    view = runner.model
    assert len(view.layers) == 2 and len(target.layers) == 4
    assert all(a is b for a, b in zip(view.layers, target.layers))
    assert view.embed is target.embed and view.norm is target.norm and view.lm_head is target.lm_head
    assert len(runner.kv_caches) == 2
    assert runner.kv_caches[0].shape == llm.engine.runner.kv_caches[0].shape
    # The view's forward == the target's first two layers + final norm (dense reference).
    from tokenbudget.engine.model.layers import rms_norm
    ids = torch.tensor([5, 17, 99, 3, 200])
    chunk = runner.chunk(_FakeReq(), 0, ids.tolist(), [0], True)
    logits = runner.forward([chunk])
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_dirs["target"]).eval()
    with torch.no_grad():
        out = hf.model(ids[None], output_hidden_states=True)
        h2 = out.hidden_states[2][0, -1]  # after two decoder layers, before the final norm
        ref = hf.lm_head(rms_norm(h2[None], hf.model.norm.weight, hf.config.rms_norm_eps))
    torch.testing.assert_close(logits, ref.float(), atol=1e-4, rtol=1e-4)


class _FakeReq:
    request_id = "fake"


def test_vocab_mismatch_is_a_value_error(tiny_dirs) -> None:
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]"):
        make_engine(tiny_dirs["target"], {"method": "draft_model", "model": tiny_dirs["other"]})


def test_too_many_self_draft_layers_is_a_value_error(tiny_dirs) -> None:
    with pytest.raises(ValueError, match=r"speculative_config\['draft_num_layers'\]"):
        make_engine(tiny_dirs["target"], {"method": "self_draft", "draft_num_layers": 5})


def test_sampled_with_seed_runs_and_is_reproducible(tiny_dirs) -> None:
    spec = {"method": "draft_model", "model": tiny_dirs["draft"], "num_speculative_tokens": 3}
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True)
              for s in range(len(PROMPTS))]
    llm = make_engine(tiny_dirs["target"], spec)
    first = token_ids(llm, PROMPTS, params)
    assert all(len(t) == 20 and all(0 <= x < VOCAB for x in t) for t in first)
    stats = llm.get_spec_stats()
    assert stats.num_draft_tokens > 0 and 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    assert token_ids(llm, PROMPTS, params) == first  # per-request seeds: same tokens again


def test_sampled_identical_drafter_accepts_all(tiny_dirs) -> None:
    """q == p exactly (same model, same processing): min(1, p/q) = 1, every draft is accepted."""
    spec = {"method": "self_draft", "draft_num_layers": 4, "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=3, ignore_eos=True)
    llm = make_engine(tiny_dirs["target"], spec)
    token_ids(llm, PROMPTS[:2], params)
    assert llm.get_spec_stats().acceptance_rate == 1.0


def test_preemption_and_chunked_prefill(tiny_dirs) -> None:
    """Tiny KV pool (requests preempted and recomputed) + 8-token budget (chunked prefill); the
    drafter has its own shape (hidden 32, 1 layer)."""
    prompts = [f"prompt number {i}: " + "ab" * (3 + 2 * i) for i in range(4)]
    # The KV budget pays for the target's and the drafter's caches over the same 16 blocks.
    budget = _kv_bytes(tiny_dirs["target"], blocks=16) + _kv_bytes(tiny_dirs["small"], blocks=16)
    opts = dict(kv_cache_memory_bytes=budget, block_size=8,
                max_num_batched_tokens=8)
    want = token_ids(make_engine(tiny_dirs["target"]), prompts, greedy(40))
    llm = make_engine(tiny_dirs["target"], {"method": "draft_model", "model": tiny_dirs["small"],
                                            "num_speculative_tokens": 3}, **opts)
    assert token_ids(llm, prompts, greedy(40)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.get_spec_stats().num_draft_tokens > 0


def _kv_bytes(path, blocks: int, block_size: int = 8) -> int:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return blocks * c["num_hidden_layers"] * 2 * block_size * c["num_key_value_heads"] * head_dim * 4


@pytest.mark.parametrize("method", ["draft_model", "self_draft"])
def test_identical_drafter_kv_stays_exact_under_stress(tiny_dirs, method) -> None:
    """Greedy equality cannot see a stale drafter KV (the verify fixes any draft); acceptance
    can: a drafter identical to the target accepts EVERY draft only if its KV is right after
    chunked prefill, preemption + recompute and prefix-cache hits."""
    prompts = [f"prompt number {i}: " + "ab" * (3 + 2 * i) for i in range(4)] * 2  # repeats: cache hits
    spec = ({"method": "draft_model", "model": tiny_dirs["target"]} if method == "draft_model"
            else {"method": "self_draft", "draft_num_layers": 4})
    spec["num_speculative_tokens"] = 3
    target_bytes = _kv_bytes(tiny_dirs["target"], blocks=12)  # + the drafter's cache, same 12 blocks
    with open(os.path.join(tiny_dirs["target"], "config.json")) as f:
        drafter_share = 1.0 if method == "draft_model" else 4 / json.load(f)["num_hidden_layers"]
    opts = dict(kv_cache_memory_bytes=int(target_bytes * (1 + drafter_share)) + 1, block_size=8,
                max_num_batched_tokens=8)
    want = token_ids(make_engine(tiny_dirs["target"]), prompts, greedy(32))
    llm = make_engine(tiny_dirs["target"], spec, **opts)
    assert token_ids(llm, prompts, greedy(32)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.prefix_hits > 0
    stats = llm.get_spec_stats()
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0


@pytest.mark.parametrize("method", ["draft_model", "self_draft"])
def test_the_drafters_cost_is_in_the_start_up_prior(tiny_dirs, baseline, method) -> None:
    """Under "auto" the controller's cost model starts with the drafter's cost timed at start-up
    (``probe_cost``, on throw-away KV blocks that no request holds yet), and greedy output still
    equals plain decoding after it."""
    spec = {"method": method, "num_speculative_tokens": "auto"}
    spec.update({"model": tiny_dirs["draft"]} if method == "draft_model" else {"draft_num_layers": 3})
    llm = make_engine(tiny_dirs["target"], spec)
    per_request, per_row = llm.engine.speculator.controller.cost_model.drafter_weights
    assert per_request + per_row > 0
    assert token_ids(llm, PROMPTS, greedy()) == baseline
    llm.engine.core.scheduler.check_integrity()
