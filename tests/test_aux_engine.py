"""EAGLE-3 taps through the real engine: every step's ``ModelRunnerOutput.aux_hidden_states`` row
is the target's state at that row's token and context, under chunked prefill, n-gram verifies
mixed with prefill chunks, and steps that failed after their forward and ran again.

Tiny random Llama, int4 on the C decoder forward (batch invariant by construction), so each row
must equal BITWISE the same position computed alone in one prefill of its context.
"""

from __future__ import annotations

import torch

from tokenbudget import LLM, RequestOutputKind, SamplingParams
from tokenbudget.engine.worker.kv_cache_alloc import allocate_kv_caches
from tokenbudget.engine.worker.model_runner import ModelRunner
from tokenbudget.scheduler.output import ScheduledRequest, SchedulerOutput

from engine_fixtures import bounded
from tiny_llama import make_tiny_llama

TAPS = (3, 1)


class FailingAfterForward:
    """Attempts number ``fail_at`` (1-based) raise after their forward ran: the core rolls the
    step back and runs it again."""

    def __init__(self, inner, fail_at: set[int]) -> None:
        self.inner, self.fail_at, self.attempts, self.failed = inner, fail_at, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, sched: SchedulerOutput):
        out = self.inner.execute(sched)
        self.attempts += 1
        if self.attempts in self.fail_at:
            self.failed += 1
            raise RuntimeError("injected fault after the forward")
        return out


class RecordingRunner:
    """Keeps each output the core receives, with the step it answers."""

    def __init__(self, inner) -> None:
        self.inner, self.steps = inner, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, sched: SchedulerOutput):
        out = self.inner.execute(sched)
        self.steps.append((sched, out))
        return out


def _alone(model, config, tokens: list[int]) -> torch.Tensor:
    """The taps of every position of ``tokens``, one prefill in a fresh pool."""
    block = 8
    runner = ModelRunner(model, config, allocate_kv_caches(config, 16, block, torch.float32, "cpu"), block, None)
    sr = ScheduledRequest(request_id="ref", num_computed_tokens=0, token_ids=tokens, spec_token_ids=[],
                          block_ids=list(range(-(-len(tokens) // block))), is_new=True, needs_sample=False)
    ids, pos, md, _ = runner.prepare_inputs(SchedulerOutput([sr], total_num_scheduled_tokens=len(tokens)))
    return model(ids, pos, md, runner.kv_caches, aux_layers=TAPS)[1]


def test_engine_steps_carry_each_rows_taps_through_chunks_verifies_and_retries(tmp_path):
    path = make_tiny_llama(tmp_path / "target", layers=4, seed=0, scale=8.0)
    llm = LLM(path, quantization="int4", num_threads=1, max_num_batched_tokens=8, block_size=8,
              enable_prefix_caching=False, kv_cache_memory_bytes=4 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    engine = llm.llm_engine
    core = engine.core
    assert core.runner.model.cpu_forward is not None
    core.runner.set_aux_layers(TAPS)
    faults = FailingAfterForward(core.runner, {2, 6, 11})
    recorder = RecordingRunner(faults)
    core.runner = recorder
    prompts = {"a": [5, 6, 7, 8] * 4 + [5], "b": list(range(30, 50)), "c": [9, 10] * 6}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    final = {rid: list(p) for rid, p in prompts.items()}
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    for _ in bounded(engine.has_unfinished_requests):
        for out in engine.step():
            final[out.request_id] += out.outputs[0].token_ids
    assert faults.failed == 3

    model, config = core.runner.model, core.runner.config
    kinds, mixed = set(), False
    for sched, out in recorder.steps:
        aux = out.aux_hidden_states
        assert aux.shape == (sched.total_num_scheduled_tokens, len(TAPS) * config.hidden_size)
        for sr, rows in zip(sched.scheduled, aux.split([sr.num_tokens for sr in sched.scheduled])):
            nc = sr.num_computed_tokens
            kinds.add("verify" if sr.spec_token_ids else "chunk" if not sr.needs_sample else "decode")
            # the committed tokens before the chunk never change; the chunk itself may hold drafts
            # that were rejected later, so the reference context is what this step computed
            want = _alone(model, config, final[sr.request_id][:nc] + sr.token_ids)[nc:]
            assert torch.equal(rows, want), (sr.request_id, nc, sr.num_tokens)
        mixed |= any(sr.spec_token_ids for sr in sched.scheduled) and any(sr.num_tokens > 1 and not sr.spec_token_ids
                                                                          for sr in sched.scheduled)
    assert kinds == {"verify", "chunk", "decode"} and mixed  # a verify beside a prefill chunk in one step
