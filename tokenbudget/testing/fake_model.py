"""A fake deterministic model that really uses the paged KV cache, and a fake drafter.

The "KV" of position p is a 64-bit rolling hash of tokens[0..p], stored in the slot the block
table assigns to p; computing p reads the state of p-1 from *its* slot. So a wrong block table,
a prefix-cache hit on the wrong block, a rewind that freed a live block, or a read of a position
that was never computed changes (or breaks) the token stream. The next token after position p
is a function of that state alone, so every request has one true output: ``reference_generate``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenbudget.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.proposer import BaseProposer, Proposal

MASK = (1 << 64) - 1
SEED_STATE = 0x9E3779B97F4A7C15


def mix(state: int, token: int) -> int:
    """splitmix64-style step: the state after appending ``token``."""
    z = (state ^ ((token + 1) * 0xBF58476D1CE4E5B9)) & MASK
    z = ((z ^ (z >> 30)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


@dataclass(slots=True, frozen=True)
class FakeModelSpec:
    vocab_size: int = 64
    eos_token_id: int = 0
    eos_one_in: int = 40  # roughly one position in this many predicts EOS

    def next_token(self, state: int) -> int:
        if (state >> 7) % self.eos_one_in == 0:
            return self.eos_token_id
        return 1 + (state >> 17) % (self.vocab_size - 1)


def reference_generate(spec: FakeModelSpec, request: Request, max_model_len: int) -> list[int]:
    """The request's output run alone, sequentially, without drafts."""
    state = SEED_STATE
    for t in request.prompt_token_ids:
        state = mix(state, t)
    out: list[int] = []
    num_prompt = len(request.prompt_token_ids)
    while True:
        token = spec.next_token(state)
        out.append(token)
        n_out = len(out)
        if n_out >= request.min_tokens:
            if token == request.eos_token_id and not request.ignore_eos:
                return out
            if token in request.stop_token_ids:
                return out
        if n_out >= request.max_tokens or num_prompt + n_out >= max_model_len:
            return out
        state = mix(state, token)


class FakeModelRunner:
    """Executes a SchedulerOutput over a slot-addressed fake KV cache, verifying drafts greedily."""

    def __init__(self, spec: FakeModelSpec, num_blocks: int, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.num_steps = 0

    def _slot(self, block_ids: list[int], pos: int) -> int:
        bs = self.block_size
        return block_ids[pos // bs] * bs + pos % bs

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        spec, kv, slot = self.spec, self.kv, self._slot
        req_ids, sampled = [], []
        for sr in sched.scheduled:
            block_ids, start = sr.block_ids, sr.num_computed_tokens
            state = SEED_STATE if start == 0 else kv[slot(block_ids, start - 1)]
            assert state is not None, f"{sr.request_id}: reads position {start - 1}, never written"
            predictions = []
            for j, token in enumerate(sr.token_ids):
                state = mix(state, token)
                kv[slot(block_ids, start + j)] = state
                predictions.append(spec.next_token(state))
            req_ids.append(sr.request_id)
            if not sr.needs_sample:
                sampled.append([])
                continue
            k = len(sr.spec_token_ids)
            preds = predictions[len(predictions) - 1 - k:]
            tokens = []
            for draft, pred in zip(sr.spec_token_ids, preds):
                if draft != pred:
                    break
                tokens.append(draft)
            tokens.append(preds[len(tokens)])
            sampled.append(tokens)
        return ModelRunnerOutput(req_ids, sampled)


class FakeDrafter(BaseProposer):
    """A proposer: ``k`` drafts per request (at most what it is asked for), each the true next
    token with probability ``p_correct`` (set per step by the harness), or exactly ``forced[id]``
    for the requests listed there."""

    def __init__(self, spec: FakeModelSpec, rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self.k = 0
        self.p_correct = 0.5
        self.forced: dict[str, list[int]] = {}
        self._state: dict[str, tuple[int, int]] = {}  # request_id -> (num tokens hashed, state)

    def _state_of(self, request: Request) -> int:
        n, state = self._state.get(request.request_id, (0, SEED_STATE))
        tokens = request.all_token_ids
        for t in tokens[n:]:
            state = mix(state, t)
        self._state[request.request_id] = (len(tokens), state)
        return state

    def propose(self, requests, num_tokens) -> Proposal:
        out = []
        for request, limit in zip(requests, num_tokens):
            forced = self.forced.get(request.request_id)
            if forced is not None:
                out.append(list(forced[:limit]))
                continue
            state = self._state_of(request)
            drafts = []
            for _ in range(min(self.k, limit)):
                true = self.spec.next_token(state)
                token = true if self.rng.random() < self.p_correct else self.rng.randrange(self.spec.vocab_size)
                drafts.append(token)
                state = mix(state, token)
            out.append(drafts)
        return Proposal(out)

    def on_finished(self, request: Request) -> None:
        self._state.pop(request.request_id, None)
