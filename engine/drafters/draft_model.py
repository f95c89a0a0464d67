"""Model drafters: a separate small model ("draft_model") or the target's first N layers ("self_draft").

Per engine step, for the decoding requests the speculator hands over (every committed token but
the last has target KV: ``num_computed_tokens == L - 1`` with ``L = len(all_token_ids)``):

1. Catch-up. Each request's drafter KV is valid for positions ``[0, num_draft_computed)``, with
   ``num_draft_computed`` clamped to the request's ``num_computed_tokens`` every step (drafter
   positions past it hold drafts that were rejected, or were never verified, and are simply
   overwritten). The drafter runs positions ``[num_draft_computed, L)`` (committed tokens) and
   samples draft 1 from the logits at ``L - 1``. Catch-up chunks of all requests share one flat
   forward, split into rounds of at most ``max_num_batched_tokens`` tokens (a request seen for
   the first time recomputes its whole prefix, like a prefill).
2. k - 1 batched single-token forwards: draft j is fed at position ``L - 1 + j`` and draft j + 1
   sampled from its logits. Positions written: up to ``L + k - 2``, which the scheduler's
   lookahead reservation (``num_lookahead_tokens = max_spec_tokens``) covers.
   Afterwards ``num_draft_computed = L + k - 1``.

Why the clamp is exact: after a verify that accepted a of the drafts, ``num_computed_tokens ==
L + a`` and drafter positions ``L .. L + a - 1`` hold the accepted drafts, i.e. the committed
tokens; position ``L + a`` onwards holds a rejected draft (or nothing).

When the drafter's KV is thrown away (``num_draft_computed = 0``):
* first sight of a request. Prefix-cache hits give a new request the target's KV of a shared
  prefix, but the drafter's KV in those blocks may be missing (the earlier request was never
  drafted, or the blocks were evicted and reused), so the drafter recomputes the prefix. Writing
  a shared block's drafter slots again is harmless: same tokens, same positions, same values.
* preemption (``request.num_preemptions`` changed): the request's blocks were freed and it was
  recomputed into new ones.

Sampling: ``engine.drafters.draft_sampling`` (shared with the EAGLE-3 drafter).

Transactions: the drafter state of each request is a record of ``states`` (a ``RequestTable``),
edited in this step's own copy, so a failed step leaves the records as they were (and the drafter
KV they describe was not overwritten: a step only writes positions at or past them).

The first N layers + final norm + lm head of an untrained model ("logit lens") predict the
next token poorly until N is close to L (acceptance by N: benches/RESULTS.md, "Figures behind
decisions in the source"); self-drafting pays off only with a model trained for early exit
(LayerSkip) or with an adapter. N = L accepting everything is the check that the drafter's KV
bookkeeping is exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tokenbudget.engine.drafters.draft_runner import DraftRunner
from tokenbudget.engine.drafters.draft_sampling import sample_drafts, wants_probs
from tokenbudget.request_table import RequestTable
from tokenbudget.scheduler.drafts import draft_limit
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.proposer import BaseProposer, Proposal


@dataclass(slots=True)
class _DraftState:
    num_computed: int = 0          # drafter KV valid for positions [0, num_computed) (pre-clamp)
    num_preemptions: int = 0

    def __copy__(self) -> _DraftState:
        return _DraftState(self.num_computed, self.num_preemptions)


class DraftModelProposer(BaseProposer):
    """Drafts with a model through :class:`DraftRunner`; block tables come from ``kv_manager``."""

    def __init__(self, runner: DraftRunner, kv_manager, max_model_len: int,
                 max_batch_tokens: int = 2048) -> None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.runner = runner
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        self.states: RequestTable[_DraftState] = RequestTable("draft model state")
        self.tables = (self.states,)
        # Counters (for tests and benchmarks): tokens the drafter ran, split by kind.
        self.num_catchup_tokens = 0
        self.num_draft_forward_tokens = 0

    @classmethod
    def from_config(cls, spec_config, max_model_len: int, target, scheduler) -> DraftModelProposer:
        """``target``: the engine's ``TargetModel``; ``scheduler``: its scheduler (block tables)."""
        if target is None or scheduler is None:
            raise ValueError(f"speculative_config['method'] {spec_config.method!r} needs the "
                             "loaded target model")
        sched_cfg = scheduler.config
        common = (sched_cfg.num_blocks, sched_cfg.block_size, target.dtype, target.device)
        tcfg = target.config
        if spec_config.method == "self_draft":
            n = spec_config.draft_num_layers
            if n > tcfg.num_hidden_layers:
                raise ValueError(f"speculative_config['draft_num_layers'] {n} exceeds the target's "
                                 f"{tcfg.num_hidden_layers} layers")
            runner = DraftRunner.self_draft(target.model, tcfg, n, *common)
        elif spec_config.method == "draft_model":
            runner = _load_draft_model(spec_config.model, tcfg, max_model_len, common)
        else:
            raise ValueError(f"speculative_config['method'] {spec_config.method!r} is not a model drafter")
        return cls(runner, scheduler.kv, max_model_len, sched_cfg.max_num_batched_tokens)

    # ---- Proposer interface ----
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        """The drafts, with q ``[len(drafts), V]`` float32 for the requests that hand it over
        (``draft_sampling.wants_probs``), None for the others (greedy, seeded, no drafts)."""
        if len(requests) != len(num_tokens):
            raise ValueError(f"num_tokens has {len(num_tokens)} entries for {len(requests)} requests")
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor] | None] = [None for _ in requests]
        ks = [draft_limit(r, self.max_model_len, k) for r, k in zip(requests, num_tokens)]
        active = [i for i, k in enumerate(ks) if k > 0]
        if active:
            for i in active:  # q only for rejection sampling (random requests without a user seed)
                if wants_probs(requests[i]):
                    probs[i] = []
            self._catch_up(requests, active, drafts, probs)
            for j in range(1, max(ks[i] for i in active)):
                rows = [i for i in active if ks[i] > j]
                chunks = [self.runner.chunk(requests[i], requests[i].num_tokens - 1 + j,
                                            [drafts[i][-1]], self.kv.get_block_ids(requests[i].request_id),
                                            True) for i in rows]
                self.num_draft_forward_tokens += len(rows)
                sample_drafts(self.runner.forward(chunks), requests, rows, drafts, probs)
            for i in active:
                self.states.edit(requests[i].request_id).num_computed = requests[i].num_tokens + ks[i] - 1
        return Proposal(drafts, [torch.stack(p) if p else None for p in probs])

    def probe_cost(self, num_tokens: int) -> float:
        """Seconds a draft of ``num_tokens`` tokens costs the drafter for one request: a one-row
        catch-up and ``num_tokens - 1`` one-row forwards, each with its argmax, on throw-away KV
        in blocks 0.. (at start-up, where the controller's prior is timed, no request holds them;
        ``engine.drafters.step_cost`` writes the target's the same way)."""
        runner = self.runner
        probe = SimpleNamespace(request_id="__draft_cost_probe__")
        blocks = list(range(-(-num_tokens // runner.block_size)))
        start = time.perf_counter()
        with torch.inference_mode():
            for pos in range(num_tokens):
                runner.forward([runner.chunk(probe, pos, [0], blocks, True)]).argmax(dim=-1).tolist()
        return time.perf_counter() - start

    @property
    def num_tracked_requests(self) -> int:
        return len(self.states)

    # ---- internals ----
    def _state_of(self, request: Request) -> _DraftState:
        """The request's drafter state, this step's own copy (created on first sight)."""
        rid = request.request_id
        if rid not in self.states:
            self.states.set(rid, _DraftState(num_preemptions=request.num_preemptions))
        st = self.states.edit(rid)
        if st.num_preemptions != request.num_preemptions:  # recomputed into new blocks
            st.num_preemptions = request.num_preemptions
            st.num_computed = 0
        st.num_computed = min(st.num_computed, request.num_computed_tokens)
        return st

    def _catch_up(self, requests, active: list[int], drafts, probs) -> None:
        """Run committed positions [num_draft_computed, L) of every active request (rounds of at
        most ``max_batch_tokens`` tokens) and sample each request's first draft."""
        start = {i: self._state_of(requests[i]).num_computed for i in active}
        todo = list(active)
        while todo:
            budget, chunks, rows = self.max_batch_tokens, [], []
            for i in todo:
                if budget <= 0:
                    break
                req = requests[i]
                end = req.num_tokens
                n = min(end - start[i], budget)
                sample = start[i] + n == end
                chunks.append(self.runner.chunk(req, start[i], req.all_token_ids[start[i]:start[i] + n],
                                                self.kv.get_block_ids(req.request_id), sample))
                if sample:
                    rows.append(i)
                start[i] += n
                budget -= n
            self.num_catchup_tokens += sum(c.num_tokens for c in chunks)
            logits = self.runner.forward(chunks)
            if rows:
                sample_drafts(logits, requests, rows, drafts, probs)
            todo = [i for i in todo if start[i] < requests[i].num_tokens]


def _load_draft_model(path: str, target_config, max_model_len: int, common) -> DraftRunner:
    from tokenbudget.engine.loader import load_model_files
    from tokenbudget.engine.model import build_model

    num_blocks, block_size, dtype, device = common
    loaded = load_model_files(path, dtype=dtype)
    cfg = loaded.config
    if cfg.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config['model'] {path!r} has vocab_size {cfg.vocab_size}, "
                         f"the target has {target_config.vocab_size}: a drafter must share the "
                         "target's vocabulary")
    if cfg.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config['model'] {path!r} supports "
                         f"{cfg.max_position_embeddings} positions, less than max_model_len="
                         f"{max_model_len}")
    model = build_model(cfg, loaded.state_dict, dtype, device)
    loaded.state_dict.clear()
    return DraftRunner(model, cfg, num_blocks, block_size, dtype, device)
