"""The EAGLE-3 drafter (engine/drafters/eagle3_proposer.py) on a tiny random target with random heads
written in the published layout: losslessness under chunked prefill, preemption, prefix caching,
n > 1, structured output and sampling; the head's own KV against a from-scratch reference; the
step transaction (rollback) and the one release path. The loader and the validation errors:
test_eagle3_loading.py."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import transformers

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.api.structured_params import StructuredOutputsParams
from tokenbudget.engine.drafters.eagle3_kv import HeadState
from tokenbudget.engine.entrypoints.llm import LLM
from tokenbudget.engine.model.eagle3 import load_eagle3
from tokenbudget.testing.faults import FaultInjectingRunner, FaultPlan

from eagle3_fixtures import (
    PROMPTS,
    baseline_tokens,
    eagle,
    engine,
    greedy,
    kv_bytes,
    make_dirs,
    reference_drafts,
    token_ids,
)
from engine_fixtures import bounded
from tiny_llama import VOCAB


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_dirs(tmp_path_factory.mktemp("eagle3"))


@pytest.fixture(scope="module")
def baseline(dirs):
    return baseline_tokens(dirs)


def stressed(dirs, blocks: int, **opts) -> dict:
    """A KV pool of ``blocks`` blocks of 8 (preemption) and an 8-token step budget (chunked prefill)."""
    return dict(kv_cache_memory_bytes=kv_bytes(dirs["target"], blocks), block_size=8, max_num_batched_tokens=8,
                **opts)


def test_greedy_equals_plain_decoding(dirs, baseline) -> None:
    llm = engine(dirs["target"], eagle(dirs["head"]))
    assert token_ids(llm, PROMPTS, greedy()) == baseline
    stats = llm.get_spec_stats()
    assert stats.num_draft_tokens > 0
    proposer = llm.engine.speculator.proposer
    assert proposer.num_catchup_tokens > 0 and proposer.num_draft_forward_tokens > 0
    assert proposer.num_tracked_requests == 0  # released on the one release path
    llm.engine.core.scheduler.check_integrity()


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_lossless_under_chunking_preemption_and_prefix_hits(dirs, quantization) -> None:
    """fp32: the head's torch forward; int8: its C forward where the C kernels run."""
    prompts = [f"prompt number {i}: " + "ab" * (3 + 2 * i) for i in range(4)] * 2  # repeats: cache hits
    want = token_ids(engine(dirs["target"], quantization=quantization), prompts, greedy(32))
    llm = engine(dirs["target"], eagle(dirs["head"]), quantization=quantization, **stressed(dirs, 12))
    assert token_ids(llm, prompts, greedy(32)) == want
    sched = llm.engine.core.scheduler
    assert sched.num_preemptions > 0 and sched.kv.prefix_hits > 0
    assert llm.get_spec_stats().num_draft_tokens > 0
    assert llm.engine.speculator.proposer.num_tracked_requests == 0
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("stress", [True, False], ids=["chunked-preempted", "whole-prompt"])
def test_head_kv_matches_a_from_scratch_reference(dirs, stress) -> None:
    """Greedy equality cannot see a wrong head KV (verification repairs any draft); the drafts
    can: under chunked prefill and preemption (no prefix cache, so every position has its tap
    states), and with whole prompts (catch-ups past the small-query attention path), every draft
    equals the head run from scratch on HF's hidden states, and draft 1's logits match."""
    head = load_eagle3(dirs["head"])
    hf = transformers.LlamaForCausalLM.from_pretrained(dirs["target"]).eval()
    opts = stressed(dirs, 12, enable_prefix_caching=False) if stress else {}
    llm = engine(dirs["target"], eagle(dirs["head"], k=3), **opts)
    proposer = llm.engine.speculator.proposer
    seen = []
    inner = proposer.propose

    def recording(requests, num_tokens):
        proposal = inner(requests, num_tokens)
        for r, d in zip(requests, proposal.token_ids):
            if d:
                seen.append((list(r.all_token_ids), d, proposer.states[r.request_id].last_logits.clone()))
        return proposal

    proposer.propose = recording
    prompts = [f"prompt number {i}: " + "ab" * (3 + 2 * i) for i in range(4)]
    if not stress:
        prompts = [p * 4 for p in prompts]  # > SMALL_QUERY rows in one catch-up
    token_ids(llm, prompts, greedy(24))
    assert (llm.engine.core.scheduler.num_preemptions > 0) == stress
    assert len(seen) > 20
    for tokens, drafts, logits in seen:
        want, want_logits = reference_drafts(hf, head, tokens, len(drafts))
        assert drafts == want
        assert float((logits - want_logits).abs().max()) <= 1e-3 * float(want_logits.abs().max())


def test_n_greater_than_one_children_borrow_the_prompt_rows(dirs) -> None:
    """Children 1..n-1 take the prompt from child 0's cached blocks (no tap states for it): they
    copy child 0's head rows, so no child has a gap and every draft equals the from-scratch
    reference."""
    head = load_eagle3(dirs["head"])
    hf = transformers.LlamaForCausalLM.from_pretrained(dirs["target"]).eval()
    llm = engine(dirs["target"], eagle(dirs["head"], k=3))
    proposer = llm.engine.speculator.proposer
    seen, gaps = [], []
    inner = proposer.propose

    def recording(requests, num_tokens):
        proposal = inner(requests, num_tokens)
        seen.extend((list(r.all_token_ids), d) for r, d in zip(requests, proposal.token_ids) if d)
        gaps.extend(st.n != st.next_pos for st in proposer.states.values())
        return proposal

    proposer.propose = recording
    out = llm.generate(["prompt number 7: " + "ab" * 20], greedy(16, n=3), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert llm.engine.core.scheduler.kv.prefix_hits > 0 and proposer.num_borrowed_rows > 0
    assert gaps and not any(gaps)
    assert len(seen) > 10
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, head, tokens, len(drafts))[0]


def test_n_greater_than_one_and_structured_output(dirs) -> None:
    base = engine(dirs["target"])
    llm = engine(dirs["target"], eagle(dirs["head"]))
    params = greedy(16, n=3)
    assert [[list(c.token_ids) for c in o.outputs] for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)] == \
           [[list(c.token_ids) for c in o.outputs] for o in base.generate(PROMPTS[:2], params, use_tqdm=False)]
    so = greedy(20, structured_outputs=StructuredOutputsParams(regex=r"(ab|ba)+c"))
    assert token_ids(llm, PROMPTS[:2], so) == token_ids(base, PROMPTS[:2], so)
    assert llm.engine.speculator.proposer.num_tracked_requests == 0


def test_sampled_requests(dirs) -> None:
    """Seeded: the coupled rule makes the output exactly plain decoding's. Unseeded: q (the head's
    own distribution over the target vocabulary, zero outside the draft vocabulary) goes to the
    rejection sampler."""
    seeded = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in range(4)]
    llm = engine(dirs["target"], eagle(dirs["head"]))
    assert token_ids(llm, PROMPTS, seeded) == token_ids(engine(dirs["target"]), PROMPTS, seeded)
    proposer = llm.engine.speculator.proposer
    handed = []
    inner = proposer.propose

    def recording(requests, num_tokens):
        proposal = inner(requests, num_tokens)
        handed.extend(p for p in proposal.probs or [] if p is not None)
        return proposal

    proposer.propose = recording
    out = token_ids(llm, PROMPTS, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    assert all(len(t) == 16 for t in out)
    assert handed
    in_vocab = load_eagle3(dirs["head"]).t2d
    for q in handed:
        assert q.shape[1] == VOCAB
        torch.testing.assert_close(q.sum(dim=1), torch.ones(q.shape[0]))
        assert float(q[:, ~in_vocab].sum()) == 0.0


def test_failed_step_rolls_the_head_state_back(dirs, baseline) -> None:
    llm = engine(dirs["target"], eagle(dirs["head"]))
    core = llm.engine.core
    proposer = core.speculator.proposer
    restored = []
    inner_attempt = core._attempt
    fields = [f.name for f in dataclasses.fields(HeadState)]

    def attempt(only):  # a failed attempt leaves every head state as it found it: same record, same fields
        before = {rid: (st, [getattr(st, f) for f in fields]) for rid, st in proposer.states.items()}
        try:
            return inner_attempt(only)
        except BaseException:
            now = dict(proposer.states.items())
            assert now.keys() == before.keys()
            for rid, (st, values) in before.items():
                assert now[rid] is st
                assert all((a is b) if isinstance(a, (torch.Tensor, tuple)) else a == b
                           for a, b in zip([getattr(st, f) for f in fields], values))
            restored.append(len(now))
            raise

    core._attempt = attempt
    plan = FaultPlan(late=True)
    core.runner = FaultInjectingRunner(core.runner, plan)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"f{i}", p, greedy())
    out: dict[str, list[int]] = {}
    step = 0
    for _ in bounded(eng.has_unfinished_requests):
        plan.transient = 1 if step in (3, 5, 6) else 0  # decoding steps: the head has state to restore
        for o in eng.step():
            out[o.request_id] = list(o.outputs[0].token_ids)
        step += 1
    assert [out[f"f{i}"] for i in range(len(PROMPTS))] == baseline
    assert plan.num_fired == 3 and len(restored) == 3 and min(restored) > 0
    assert proposer.num_tracked_requests == 0


def test_abort_releases_the_head_state(dirs) -> None:
    llm = engine(dirs["target"], eagle(dirs["head"]))
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"a{i}", p, greedy(40))
    for _ in range(6):
        eng.step()
    proposer = eng.speculator.proposer
    assert proposer.num_tracked_requests > 0
    for i in range(len(PROMPTS)):
        eng.abort_request(f"a{i}", missing_ok=True)
    assert proposer.num_tracked_requests == 0
    eng.core.scheduler.check_integrity()


def test_quantized_target_runs_a_quantized_head(dirs) -> None:
    """int8 target on the CPU: the head's linears are int8 too (its cost at batch 1 is its weight
    bytes, k times per step) and its forward is the C call where the C kernels run; greedy output
    still equals plain decoding on the same target."""
    want = token_ids(engine(dirs["target"], quantization="int8"), PROMPTS, greedy())
    llm = engine(dirs["target"], eagle(dirs["head"]), quantization="int8")
    assert token_ids(llm, PROMPTS, greedy()) == want
    head = llm.engine.speculator.proposer.head
    assert type(head.lm_head.quant).__name__ == "QuantLinear" and head.lm_head.quant.mode == "int8"
    assert head.midlayer.mlp.down_proj.quant.mode == "int8"
    assert llm.get_spec_stats().num_draft_tokens > 0
    from tokenbudget.kernels.cpu.native import library
    if library() is not None:  # the head's forward is the C call (tests/test_eagle3_cpu_forward.py)
        assert llm.engine.speculator.proposer.cpu_forward is not None


def test_sampling_features_and_ids_outside_the_draft_vocabulary(dirs) -> None:
    """Penalties, bias, min_tokens, bad words, logprobs: greedy output equals plain decoding. With
    ``allowed_token_ids`` all outside the head's draft vocabulary every draft row holds only
    out-of-vocabulary ids: the head still drafts (never a 'no token allowed' request fault)."""
    in_vocab = load_eagle3(dirs["head"]).t2d
    outside = [i for i in range(VOCAB) if not in_vocab[i]]
    cases = [greedy(20, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, min_tokens=10,
                    logit_bias={int(outside[0]): 3.0}, bad_words=["ab"], logprobs=2),
             greedy(12, allowed_token_ids=outside)]
    base = engine(dirs["target"])
    llm = engine(dirs["target"], eagle(dirs["head"]))
    for params in cases:
        got = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        want = base.generate(PROMPTS[:2], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert all(o.outputs[0].finish_reason == "length" for o in got)
    assert llm.get_spec_stats().num_draft_tokens > 0


def test_pending_tap_rows_are_capped(dirs, baseline, monkeypatch) -> None:
    """A request that queues more tap rows than ``MAX_PENDING_ROWS`` (a long prompt) keeps the
    newest: the head's K/V starts later (a gap, like a cache hit), output unchanged."""
    import tokenbudget.engine.drafters.eagle3_proposer as module
    monkeypatch.setattr(module, "MAX_PENDING_ROWS", 8)
    llm = engine(dirs["target"], eagle(dirs["head"]))
    proposer = llm.engine.speculator.proposer
    kv_rows = []
    inner = proposer.propose

    def recording(requests, num_tokens):
        proposal = inner(requests, num_tokens)
        kv_rows.extend((r.num_computed_tokens, proposer.states[r.request_id].n) for r in requests)
        return proposal

    proposer.propose = recording
    assert token_ids(llm, PROMPTS, greedy()) == baseline
    assert kv_rows and all(n < computed for computed, n in kv_rows)  # the prompt's start was dropped
    assert llm.get_spec_stats().num_draft_tokens > 0


def test_shipped_head_on_the_default_model() -> None:
    """``"model"`` omitted: the head shipped for SmolLM2-135M-Instruct, on the default model as
    users run it (int4 on the C kernels: the head quantized alike, its lm head too, and its
    forward the C call where the C kernels run); greedy output equals plain decoding."""
    from tokenbudget.engine.drafters.eagle3_build import shipped_head_dir
    from tokenbudget.kernels.cpu.native import library

    from engine_fixtures import ENGINE_OPTS, default_target

    prompts = ["Tell me about the moon.", "def fibonacci(n):"]
    target = default_target("auto")
    want = token_ids(LLM(target, **ENGINE_OPTS), prompts, greedy(24))
    llm = LLM(target, speculative_config={"method": "eagle3", "num_speculative_tokens": 3}, **ENGINE_OPTS)
    assert token_ids(llm, prompts, greedy(24)) == want
    proposer = llm.engine.speculator.proposer
    assert proposer.head.config.aux_layer_ids == (2, 15, 27) and os.path.isdir(shipped_head_dir())
    assert proposer.head.lm_head.quant.mode == "int4"  # the draft lm head follows the target's int4
    assert (proposer.cpu_forward is not None) == (library() is not None)
    assert llm.get_spec_stats().num_draft_tokens > 0 and proposer.num_tracked_requests == 0


@pytest.mark.parametrize("k", ["auto", 5])
def test_suffix_decoding_where_text_repeats(dirs, k) -> None:
    """``enable_suffix_decoding``: repetitive prompts verify long suffix drafts, the others the
    head's (under "auto": suffix drafts first, cut by the controller); greedy output equals plain
    decoding; the suffix proposer's state is released too."""
    prompts = ["abc " * 12 + "abc", "The quick brown fox", "hello world, " * 6 + "hello"]
    want = token_ids(engine(dirs["target"]), prompts, greedy(32))
    spec = {**eagle(dirs["head"], k=k), "enable_suffix_decoding": True}
    llm = engine(dirs["target"], spec)
    assert llm.engine.speculator.max_k == (24 if k == "auto" else k)  # auto: the suffix tree depth
    assert token_ids(llm, prompts, greedy(32)) == want
    proposer = llm.engine.speculator.proposer
    assert proposer.num_suffix_drafts > 0 and proposer.num_catchup_tokens > 0
    if k != "auto":  # "auto" prices the head's draft steps (about the tiny target's step) and may skip them
        assert proposer.num_draft_forward_tokens > 0
    assert proposer.num_tracked_requests == 0 and not proposer.suffix.local


def test_controller_learns_each_source_apart(dirs) -> None:
    """Under "auto" the controller learns a request's suffix drafts under their kind
    (``("suffix", match class)``) and its head drafts under ``HEAD_KIND``; both are forgotten
    on release."""
    from tokenbudget.spec.speculator import HEAD_KIND
    spec = {**eagle(dirs["head"], k="auto"), "enable_suffix_decoding": True}
    llm = engine(dirs["target"], spec)
    eng = llm.engine
    eng.add_request("rep", "abc " * 12 + "abc", greedy(40))
    ctrl = eng.speculator.controller
    kinds: set = set()
    for _ in bounded(eng.has_unfinished_requests):
        eng.step()
        kinds |= {kd for kd in ctrl.kinds if "rep" in ctrl.estimator(kd)}
    assert any(isinstance(kd, tuple) and kd[0] == "suffix" for kd in kinds)
    assert HEAD_KIND in ctrl.kinds
    assert not ctrl.tracked_requests()  # every kind's row forgotten


def test_the_heads_cost_is_in_the_start_up_prior(dirs) -> None:
    """The controller's cost model starts with a price for the head's drafts, timed at start-up
    (``Eagle3Proposer.probe_cost`` beside the verify probes), not at zero: a prior without it had
    the controller draft 3 tokens a step at 20-30 % acceptance until the online fit caught up.
    A free drafter (n-gram) has no such probe and its prior prices nothing."""
    llm = engine(dirs["target"], eagle(dirs["head"], k="auto"))
    per_request, per_row = llm.engine.speculator.controller.cost_model.drafter_weights
    assert per_request + per_row > 0
    proposer = llm.engine.speculator.proposer
    assert proposer.num_tracked_requests == 0 and proposer.num_catchup_tokens == 0  # the probe left nothing
    ngram = engine(dirs["target"], {"method": "ngram", "num_speculative_tokens": "auto"})
    assert ngram.engine.speculator.controller.cost_model.drafter_weights == (0.0, 0.0)
    assert ngram.engine.speculator.proposer.probe_cost(3) is None


def test_controller_learns_the_heads_own_cost(dirs, monkeypatch) -> None:
    """Under "auto" every committed step tells the cost model how many requests the head drafted
    for and how many draft rows it ran (``StepShape.draft_requests`` / ``draft_rows``); suffix
    drafts beside it are free and not counted. (The head's start-up price is left out of the prior
    here: on the tiny target a head step costs about a target step, and priced, "auto" drafts with
    it on only a few steps; this test is about the accounting.)"""
    from tokenbudget.engine.drafters.eagle3_proposer import Eagle3Proposer
    from tokenbudget.spec.proposer import BaseProposer
    monkeypatch.setattr(Eagle3Proposer, "probe_cost", BaseProposer.probe_cost)
    spec = {**eagle(dirs["head"], k="auto"), "enable_suffix_decoding": True}
    llm = engine(dirs["target"], spec)
    eng = llm.engine
    ctrl = eng.speculator.controller
    shapes = []
    observe_step = ctrl.observe_step
    ctrl.observe_step = lambda shape, seconds: (shapes.append(shape), observe_step(shape, seconds))
    # k = min(cap, 3) whatever the controller chose (its choice still runs, for its state): the
    # drafts no longer follow the measured step times, which made this count flaky under load, and
    # below the cap a suffix draft shorter than SUFFIX_MIN_DRAFT is long enough for the k asked, so
    # the head's ``propose`` takes it instead of drafting (the accounting must not count it).
    choose = ctrl.choose
    ctrl.choose = lambda reqs, base, caps, *rest: (choose(reqs, base, caps, *rest), [min(c, 3) for c in caps])[1]
    eng.add_request("chat", "tell me a story about a cat", greedy(24))
    eng.add_request("rep", "abc " * 12 + "abc", greedy(24))
    for _ in bounded(eng.has_unfinished_requests):
        eng.step()
    drafted = [s for s in shapes if s.draft_requests]
    proposer = eng.speculator.proposer
    assert drafted and all(1 <= s.draft_requests <= 2 and s.draft_rows >= s.draft_requests for s in drafted)
    # the head's draft rows, exactly: draft 1 of each drafted request comes from its catch-up, each
    # other from one head forward (every committed step is observed; no step is retried here)
    drafts = sum(s.draft_rows for s in drafted)
    assert proposer.num_draft_forward_tokens == drafts - sum(s.draft_requests for s in drafted)
