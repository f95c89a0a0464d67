"""EAGLE-3 taps (``engine/model/aux_states.py``): the target's residual stream at the input of
chosen layers, out of the forward that already runs, on every forward path.

- the torch forward's taps are HF transformers' ``output_hidden_states[i]`` (tiny random Llama,
  chunked prefill of several requests through ``ModelRunner.execute``);
- the runner's rows are in the step's flat order for a mixed decode + verify + prefill-chunk step,
  and a rerun of the step recomputes them;
- the C decoder forward's taps equal the torch path's within the kernels' tolerance, for every C
  variant this CPU runs, and its output stays bitwise the same with taps on and off;
- bad ids are refused; nothing is left on the model (the forward returns the taps); the default
  model taps on its C path. (The CUDA graph wrapper's taps: tests/test_cuda_graphs.py.)
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.engine.model import build_model
from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.eagle3 import default_aux_layer_ids
from tokenbudget.engine.model.quant import quantize_model
from tokenbudget.engine.worker.kv_cache_alloc import allocate_kv_caches
from tokenbudget.engine.worker.model_runner import ModelRunner
from tokenbudget.engine.worker.sampler import SamplerOutput
from tokenbudget.scheduler.output import SchedulerOutput
from tokenbudget.scheduler.request import Request

import batch_schedules as tbi
from model_helpers import scheduled

TAPS = (2, 0, 3)  # not sorted: columns follow the ids' order; 0 = the embedding


def _argmax_sampler(logits, rows):
    out, r = [], 0
    for row in rows:
        r += row.num_drafts + 1
        out.append([int(logits[r - 1].argmax())])
    return SamplerOutput(out)


def _runner(model, cfg, num_blocks=96, block_size=4):
    return ModelRunner(model, cfg, allocate_kv_caches(cfg, num_blocks, block_size, torch.float32, "cpu"),
                       block_size, _argmax_sampler)


def _hf_tiny(layers=4):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      rms_norm_eps=1e-6, attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF inits norms to 1: randomise them
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
    return hf, cfg


def test_torch_taps_are_hf_output_hidden_states_under_chunked_prefill():
    hf, cfg = _hf_tiny()
    model = build_model(cfg, hf.state_dict(), torch.float32, "cpu")
    runner = _runner(model, cfg)
    runner.set_aux_layers(TAPS)
    rng = random.Random(3)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (13, 30, 5)]
    reqs = [Request(f"r{i}", p) for i, p in enumerate(prompts)]
    tables = [list(range(10 * i, 10 * i + 8)) for i in range(len(prompts))]
    done, got = [0] * len(prompts), [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):  # every request in each step, random chunks
        sched, owners = SchedulerOutput(), []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = min(len(p) - done[i], rng.randint(1, 7))
                sched.scheduled.append(scheduled(reqs[i], done[i], n, p[done[i]:done[i] + n], [], tables[i]))
                owners.append((i, n))
                done[i] += n
        aux = runner.execute(sched).aux_hidden_states
        assert aux.shape == (sum(n for _, n in owners), len(TAPS) * cfg.hidden_size) and aux.dtype == torch.float32
        for (i, n), rows in zip(owners, aux.split([n for _, n in owners])):
            got[i].append(rows)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            states = hf(torch.tensor([p]), output_hidden_states=True).hidden_states
        want = torch.cat([states[i][0] for i in TAPS], dim=1)
        torch.testing.assert_close(torch.cat(g), want, atol=2e-5, rtol=1e-5)
    runner.set_aux_layers(None)
    assert runner.execute(SchedulerOutput([scheduled(reqs[0], 0, 2, prompts[0][:2], [], tables[0])])
                          ).aux_hidden_states is None


def _alone(model, cfg, tokens, taps):
    """The taps at every position of ``tokens``, one prefill alone in a fresh pool."""
    runner = _runner(model, cfg)
    runner.set_aux_layers(taps)
    req = Request("ref", list(tokens))
    return runner.execute(SchedulerOutput([scheduled(req, 0, len(tokens), tokens, [], list(range(20)))])
                          ).aux_hidden_states


def test_runner_rows_follow_the_steps_flat_order_for_decode_verify_and_prefill_chunk():
    cfg = tbi.CFG
    model = build_model(cfg, tbi.random_state_dict(cfg, seed=1), torch.float32, "cpu")
    runner = _runner(model, cfg)
    runner.set_aux_layers((1, 0))
    a = Request("a", list(range(9)))               # decode: 8 computed, 1 scheduled
    b = Request("b", list(range(10, 16)))          # verify: 5 computed, last committed + 3 drafts
    b.spec_token_ids = [1, 2, 3]
    c = Request("c", list(range(20, 40)))          # first prefill chunk of 7 of a 20-token prompt
    ta, tb, tc = [3, 9, 30], [17, 2, 12], [5, 11]
    runner.execute(SchedulerOutput([scheduled(a, 0, 8, a.all_token_ids[:8], [], ta),
                                    scheduled(b, 0, 5, b.all_token_ids[:5], [], tb)]))
    sched = SchedulerOutput([scheduled(a, 8, 1, [8], [], ta), scheduled(b, 5, 4, [15, 1, 2, 3], [1, 2, 3], tb),
                             scheduled(c, 0, 7, c.all_token_ids[:7], [], tc)], total_num_scheduled_tokens=12)
    aux = runner.execute(sched).aux_hidden_states
    want = torch.cat([_alone(model, cfg, a.all_token_ids, (1, 0))[8:9],
                      _alone(model, cfg, b.all_token_ids + [1, 2, 3], (1, 0))[5:9],
                      _alone(model, cfg, c.all_token_ids[:7], (1, 0))])
    assert aux.shape == (12, 2 * cfg.hidden_size)
    torch.testing.assert_close(aux, want, atol=1e-5, rtol=0)
    # a rerun of the step (after a rollback) computes its own rows; the first result is not reused
    first = aux.clone()
    again = runner.execute(sched).aux_hidden_states
    assert again is not aux and torch.equal(aux, first) and torch.equal(again, first)


def _quantized(mode, seed):
    return quantize_model(build_model(CFG64, tbi.random_state_dict(CFG64, seed), torch.float32, "cpu"), mode)


# every linear's in_features a multiple of 32, head_dim 16: the C forward takes the model
CFG64 = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                    tie_word_embeddings=True)


def _c_step(model, runner, sched, taps):
    """The model's own forward over ``sched``: hidden, taps (None without), input ids."""
    ids, pos, md, _ = runner.prepare_inputs(sched)
    if not taps:
        return model(ids, pos, md, runner.kv_caches), None, ids
    hidden, aux = model(ids, pos, md, runner.kv_caches, aux_layers=taps)
    return hidden, aux, ids


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_c_forward_taps_match_the_torch_path_and_leave_its_output_bitwise_unchanged(variant, mode):
    model = _quantized(mode, seed=5)
    assert model.cpu_forward is not None
    rng = random.Random(6)
    seqs = [[rng.randrange(CFG64.vocab_size) for _ in range(n)] for n in (5, 40, 131)]  # 131: key tails
    reqs = [Request(f"s{i}", s) for i, s in enumerate(seqs)]
    tables = [list(range(20 * i, 20 * i + 17)) for i in range(len(seqs))]
    prefill = SchedulerOutput([scheduled(r, 0, len(s) - 3, s[:-3], [], t) for r, s, t in zip(reqs, seqs, tables)])
    # then a decode, a verify of 2 and a chunk of 3 in one step
    mixed = SchedulerOutput([scheduled(reqs[0], 2, 1, seqs[0][2:3], [], tables[0], needs_sample=False),
                             scheduled(reqs[1], 37, 3, seqs[1][37:], seqs[1][38:], tables[1], needs_sample=True),
                             scheduled(reqs[2], 128, 3, seqs[2][128:], [], tables[2])])
    results = {}
    for taps, c_path in ((None, True), (TAPS, True), (TAPS, False)):  # the torch path last
        if not c_path:
            model.cpu_forward = None
        runner = ModelRunner(model, CFG64, allocate_kv_caches(CFG64, 64, 8, torch.float32, "cpu"), 8, None)
        results[taps, c_path] = [_c_step(model, runner, s, taps) for s in (prefill, mixed)]
    for (h_off, aux_off, _), (h_on, aux_c, ids), (_, aux_torch, _) in zip(
            results[None, True], results[TAPS, True], results[TAPS, False]):
        assert aux_off is None
        assert torch.equal(h_on, h_off)  # taps change nothing the forward computes
        assert torch.equal(model.compute_logits(h_on), model.compute_logits(h_off))
        assert aux_c.shape == (ids.numel(), len(TAPS) * CFG64.hidden_size)
        h = CFG64.hidden_size
        assert torch.equal(aux_c[:, h:2 * h], model.embed[ids])  # tap 0: the embedding rows, copied
        # the same GEMMs; attention and norms round differently (as test_cpu_kernels' C vs torch)
        assert (aux_c - aux_torch).abs().max() <= 1e-2 * aux_torch.abs().max()


@pytest.fixture(scope="module")
def c_model_all_taps(c_kernels):
    """An int8 model on the C forward, and its taps of every layer over one mixed batch."""
    model = _quantized("int8", seed=9)
    runner = ModelRunner(model, CFG64, allocate_kv_caches(CFG64, 16, 8, torch.float32, "cpu"), 8, None)
    reqs = [Request(f"r{i}", list(range(3 + i, 3 + i + n))) for i, n in enumerate((9, 1, 4))]
    sched = SchedulerOutput([scheduled(r, 0, r.num_tokens, r.all_token_ids, [], [4 * i, 4 * i + 1])
                             for i, r in enumerate(reqs)])
    _, aux, _ = _c_step(model, runner, sched, tuple(range(CFG64.num_hidden_layers)))
    return model, runner, sched, aux


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, CFG64.num_hidden_layers - 1), min_size=1, max_size=4, unique=True))
def test_c_taps_are_the_named_layers_in_the_named_order(c_model_all_taps, ids):
    model, runner, sched, everything = c_model_all_taps
    h = CFG64.hidden_size
    _, aux, _ = _c_step(model, runner, sched, tuple(ids))
    assert torch.equal(aux, torch.cat([everything[:, i * h:(i + 1) * h] for i in ids], dim=1))


def test_bad_aux_layers_are_refused_naming_the_field():
    model = build_model(tbi.CFG, tbi.random_state_dict(tbi.CFG), torch.float32, "cpu")
    runner = _runner(model, tbi.CFG)
    for bad in ((0, 2), (-1,), (1, 1), ("1",), (True,), (1.0,), 3):
        with pytest.raises(ValueError, match="aux_layers"):
            runner.set_aux_layers(bad)
    assert runner.aux_layers is None
    runner.set_aux_layers(torch.tensor([1, 0]))  # what a config or a tensor of ids gives
    assert runner.aux_layers == (1, 0) and all(type(i) is int for i in runner.aux_layers)
    runner.set_aux_layers(())
    assert runner.aux_layers is None


def test_taps_are_returned_not_left_on_the_model():
    """A forward asked for taps returns them; the model keeps nothing of them (a drafting view of
    it, or the next forward, sees no state a tapped step left behind)."""
    model = build_model(tbi.CFG, tbi.random_state_dict(tbi.CFG), torch.float32, "cpu")
    runner = _runner(model, tbi.CFG)
    ids, pos, md, _ = runner.prepare_inputs(SchedulerOutput([scheduled(Request("r", [1, 2, 3]), 0, 3, [1, 2, 3], [],
                                                                       [0])]))
    before = dict(vars(model))
    hidden, aux = model(ids, pos, md, runner.kv_caches, aux_layers=(1,))
    assert aux.shape == (3, tbi.CFG.hidden_size)
    assert vars(model).keys() == before.keys() and all(vars(model)[k] is v for k, v in before.items())
    assert torch.equal(model(ids, pos, md, runner.kv_caches), hidden)


def test_default_model_taps_on_its_c_forward(c_kernels):
    from tokenbudget.engine.loader import LoadedModel
    from tokenbudget.engine.loader.target import build_target

    from engine_fixtures import default_loaded
    base = default_loaded()
    copy = LoadedModel(base.config, dict(base.state_dict), base.tokenizer, base.source, base.weight_type)
    target = build_target(copy, torch.float32, torch.device("cpu"), "auto")  # the engine's default: int4, C forward
    model, cfg = target.model, target.config
    assert model.cpu_forward is not None
    taps = default_aux_layer_ids(cfg.num_hidden_layers)
    prompt = target.tokenizer.encode("The capital of France is")
    req = Request("p", prompt)
    sched = SchedulerOutput([scheduled(req, 0, len(prompt), prompt, [], [0, 1])])
    runner = ModelRunner(model, cfg, allocate_kv_caches(cfg, 4, 16, torch.float32, "cpu"), 16, _argmax_sampler)
    runner.set_aux_layers(taps)
    aux = runner.execute(sched).aux_hidden_states
    model.cpu_forward = None
    want = runner.execute(sched).aux_hidden_states
    assert aux.shape == (len(prompt), 3 * cfg.hidden_size) and bool(aux.isfinite().all())
    assert (aux - want).abs().max() <= 1e-2 * want.abs().max()
