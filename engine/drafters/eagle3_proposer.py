"""The EAGLE-3 drafter: the head of ``engine.model.eagle3`` with its own per-request KV, fed with
the target's tap states of the verify/prefill pass that already ran.

Positions. The head's row at position ``p`` reads the target's tap states at ``p`` (fused by
``fc``) and the embedding of token ``p + 1`` and predicts token ``p + 2`` (vLLM's shift). A
decoding request has ``L`` committed tokens and target KV for ``[0, L - 1)``; its head rows are
run for every position ``p < L - 1`` whose tap states the target produced (a committed step's
valid rows: a prefill chunk's, the verified position and the accepted drafts), and the row at
``L - 2`` gives draft 1. Drafts 2..k come from k - 1 single-row steps at positions
``L - 1 .. L + k - 3`` that read the previous step's pre-norm output as ``hidden`` and the previous
draft's embedding; their K/V live only inside ``propose`` (the next step recomputes those
positions from the target's own states, as vLLM does), so rejected drafts leave nothing behind.

State per request (``HeadState``): the head's K/V over the positions it ran (rows ``[0, n)`` of
a buffer that grows by doubling; rows past ``n`` are scratch: the draft steps' K/V), ``next_pos``
(every position below it was run or has no tap state), the committed tap rows not yet run
(``pending``), and the last run row's output (``last_pos``, ``last_h``, ``last_logits``: draft 1
when nothing new came). Rows below ``n`` are never written again and every other field is
replaced, never mutated, so a snapshot is a tuple of references and ``n``.

Where tap states come from: ``on_commit`` (the commit) slices the runner's
``aux_hidden_states`` per request and queues the valid rows; ``propose`` runs them. Positions the
target did not compute have no tap states, and the head's attention simply skips them:
* a prefix-cache hit (and the children 1..n-1 of an ``n > 1`` request, whose prompt comes from
  child 0's cached blocks): when a live request's head K/V covers the same prefix without a gap
  (``n > 1`` siblings, a shared system prompt in flight), its rows are copied: a head row depends
  only on its position, its token and the target's states there, so they are the rows this
  request would have computed. Otherwise the head's K/V starts at the first computed position:
  drafts are weaker for that request (less context), never wrong: verification decides;
* preemption (recompute): rows for positions already queued or run are dropped (same committed
  tokens, same states), so the head's KV survives a preemption unchanged.

The forward: on a quantized CPU target where the C kernels run, one C call per head forward
(``cpu_forward``, ``engine.model.eagle3_cpu``: the embedding lookup, ``fc`` for a catch-up, the
layer, the lm head and the greedy draft); otherwise the head's torch forward. Both write the same
K/V rows and give the same outputs up to float rounding; ``probe_cost`` times them for the
controller's start-up prior.

Transactions: the states are records of ``states`` (a ``RequestTable``, with the suffix
proposer's tables in ``tables``): ``propose`` changes this step's own copy of each, so a failed
step leaves them as they were, and the engine's one release path drops a finished request's.
``on_commit`` runs in the commit (slicing only, no model code).

With suffix decoding (``enable_suffix_decoding``): each request first gets the suffix proposer's
draft; one of at least ``SUFFIX_MIN_DRAFT`` tokens (or the whole k) means the text repeats
(a match at least that long), and that draft is verified instead of the head's, with no
probabilities (the coupled rule verifies it). The head still catches up on every committed
position, so it drafts the next step where the repetition stops.

Sampling the head's drafts: ``engine.drafters.eagle3_sampling``.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import torch

from tokenbudget.engine.drafters.draft_sampling import wants_probs
from tokenbudget.engine.drafters.eagle3_kv import HeadState, catch_up_rounds, segment_attend
from tokenbudget.engine.drafters.eagle3_sampling import HeadSampler
from tokenbudget.engine.model.eagle3 import Eagle3Head
from tokenbudget.engine.worker.threads import intra_op_threads
from tokenbudget.request_table import RequestTable
from tokenbudget.scheduler.drafts import draft_limit
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.proposer import BaseProposer, CommittedStep, Proposal

# Committed tap rows kept per request before the oldest are dropped (a gap, like a cache hit). A
# prompt's rows wait one step; only a request the controller keeps at k = 0 for long queues more
# (4096 rows x 3 x hidden, in the head's dtype: 28 MB for the default model).
MAX_PENDING_ROWS = 4096
SUFFIX_MIN_DRAFT = 4  # a suffix draft this long (a match of >= 4 tokens) is taken over the head's


class Eagle3Proposer(BaseProposer):
    """Drafts with an :class:`Eagle3Head` over the target's embedding (``embed [V, H]``)."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, max_model_len: int,
                 max_batch_tokens: int = 2048, suffix=None, cpu_forward=None) -> None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.head = head
        self.embed = embed
        self.suffix = suffix  # a spec.suffix.SuffixProposer, or None
        # the head's forward in one C call (engine.model.eagle3_cpu.Eagle3CpuForward), or None: the
        # head's torch forward
        self.cpu_forward = cpu_forward
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        w = head.fc.weight
        self.dtype, self.device = w.dtype, w.device
        self._sampler = HeadSampler(head, self.device)
        self.states: RequestTable[HeadState] = RequestTable("eagle3 head state")
        self.tables = (self.states,) + (tuple(suffix.tables) if suffix is not None else ())
        self._threads = torch.get_num_threads()  # the engine's intra-op threads (propose runs on fewer)
        # Counters (tests, benchmarks): head rows run over target states / from its own outputs.
        self.num_catchup_tokens = 0
        self.num_draft_forward_tokens = 0
        self.num_suffix_drafts = 0  # requests' drafts taken from suffix decoding
        self.num_borrowed_rows = 0  # head K/V rows copied from a request with the same prefix

    # ---- the step's end: tap states of the committed step ----
    def on_commit(self, step: CommittedStep) -> None:
        if self.suffix is not None:
            self.suffix.on_commit(step)
        sched, aux = step.sched, step.aux_hidden_states
        if sched is None or aux is None or aux.shape[0] != sum(len(sr.token_ids) for sr in sched.scheduled):
            return  # no tap states (a runner without taps): the head skips these positions
        off = 0
        for sr, entry in zip(sched.scheduled, step.plan):
            m = len(sr.token_ids)  # the committed tokens of the chunk, then the drafts
            valid = m - len(sr.spec_token_ids) + entry.num_accepted_tokens
            rows, start, off = aux[off:off + valid], sr.num_computed_tokens, off + m
            if rows.dtype != self.dtype:
                rows = rows.to(self.dtype)
            if sr.request_id not in self.states:
                self.states.set(sr.request_id, self._new_state())
            self.states.edit(sr.request_id).queue(start, rows, MAX_PENDING_ROWS)

    # ---- Proposer interface ----
    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        """The drafts, with q ``[len(drafts), V]`` float32 where the request hands it over
        (``draft_sampling.wants_probs``; never for a suffix draft), else None."""
        self._threads = torch.get_num_threads()
        with intra_op_threads(1 if len(requests) <= SMALL_WORK else self._threads):
            return self._propose(requests, num_tokens)

    def _propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        if len(requests) != len(num_tokens):
            raise ValueError(f"num_tokens has {len(num_tokens)} entries for {len(requests)} requests")
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor] | None] = [[] if wants_probs(r) else None for r in requests]
        ks = [draft_limit(r, self.max_model_len, k) for r, k in zip(requests, num_tokens)]
        active = [i for i, k in enumerate(ks) if k > 0]
        states = {i: self._state_of(requests[i]) for i in active}
        self._catch_up(requests, states)
        receipt, kinds = None, None
        if self.suffix is not None and active:
            free = self.free_drafts([requests[i] for i in active], [ks[i] for i in active])
            receipt, kinds = free.receipt, [None] * len(requests)
            for i, f, kind in zip(list(active), free.token_ids, free.kinds):
                if f:
                    drafts[i], probs[i], kinds[i] = f, None, kind
                    active.remove(i)
        # Draft 1 from the row at L - 2 (a request whose last committed position has no tap
        # state gets no drafts this step: never wrong, and rare).
        active = [i for i in active if states[i].last_pos == requests[i].num_tokens - 2]
        if active:
            logits = torch.stack([states[i].last_logits for i in active])
            self._sampler.sample(logits, requests, active, drafts, probs, [states[i].last_greedy for i in active])
            hidden = {i: states[i].last_h for i in active}
            for i in active:
                states[i].reserve(ks[i] - 1)  # the draft steps' K/V: scratch rows past n
            for j in range(1, max(ks[i] for i in active)):
                rows = [i for i in active if ks[i] > j]
                h, out, greedy = self._forward([drafts[i][-1] for i in rows], torch.stack([hidden[i] for i in rows]),
                                               [requests[i].num_tokens - 2 + j for i in rows],
                                               [(states[i], states[i].n + j - 1, 1) for i in rows], fuse=False)
                for r, i in enumerate(rows):
                    hidden[i] = h[r]
                self.num_draft_forward_tokens += len(rows)
                self._sampler.sample(out, requests, rows, drafts, probs, greedy)
        return Proposal(drafts, [torch.stack(p) if p else None for p in probs], kinds=kinds, receipt=receipt)

    def free_drafts(self, requests: Sequence[Request], caps: Sequence[int]) -> Proposal:
        """Suffix decoding's drafts (up to ``caps``) where they are long, with their kinds
        (``("suffix", match class)``, ``spec.proposer``), else ``[]`` (the head drafts those):
        drafts that cost nothing, for the controller to cut (``spec.speculator``)."""
        out: list[list[int]] = [[] for _ in requests]
        kinds: list[Hashable] = [None] * len(requests)
        if self.suffix is None:
            return Proposal(out, kinds=kinds)
        ks = [draft_limit(r, self.max_model_len, c) for r, c in zip(requests, caps)]
        proposal = self.suffix.propose(requests, ks)
        for i, d in enumerate(proposal.token_ids):
            if d and len(d) >= min(ks[i], SUFFIX_MIN_DRAFT):
                out[i], kinds[i] = d, ("suffix", proposal.kinds[i])
                self.num_suffix_drafts += 1
        return Proposal(out, kinds=kinds, receipt=proposal.receipt)

    def probe_cost(self, num_tokens: int) -> float:
        """Seconds a draft of ``num_tokens`` tokens costs the head for one request: a one-row
        catch-up, then ``num_tokens - 1`` draft steps, through the forward ``propose`` runs (the C
        call or the torch head), on a throw-away state (``spec.proposer``)."""
        c = self.head.config
        st = self._new_state()
        st.reserve(num_tokens)
        aux = torch.zeros(1, 3 * c.target_hidden_size, dtype=self.dtype, device=self.device)
        start = time.perf_counter()
        with torch.inference_mode(), intra_op_threads(1):
            h, _, _ = self._forward([0], aux, [0], [(st, 0, 1)], fuse=True)
            for j in range(1, num_tokens):
                h, _, _ = self._forward([0], h, [j], [(st, j, 1)], fuse=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def on_finished(self, request: Request) -> None:
        if self.suffix is not None:
            self.suffix.on_finished(request)

    @property
    def num_tracked_requests(self) -> int:
        return len(self.states)

    # ---- internals ----
    def _state_of(self, request: Request) -> HeadState:
        """The request's head state, this step's own copy (created on first sight)."""
        rid = request.request_id
        if rid not in self.states:
            self.states.set(rid, self._new_state())
        st = self.states.edit(rid)
        if st.n == 0 and st.pending and st.pending[0][0] > 0:
            self._borrow_prefix(st, request.all_token_ids)
        st.tokens = request.all_token_ids
        return st

    def _borrow_prefix(self, st: HeadState, tokens: list[int]) -> None:
        """Rows for positions ``[0, s)`` (``s``: the first position with tap states) from a live
        request whose head K/V covers them without a gap and whose tokens ``[0, s]`` agree."""
        s = st.pending[0][0]
        for other in self.states.values():
            if other is st or other.tokens is None or other.n < s or other.n != other.next_pos:
                continue
            if other.tokens[:s + 1] == tokens[:s + 1]:
                st.copy_prefix(other, s)
                self.num_borrowed_rows += s
                return

    def _catch_up(self, requests: Sequence[Request], states: dict[int, HeadState]) -> None:
        """Run every queued tap row of ``states`` in rounds of at most ``max_batch_tokens`` rows,
        each round one head forward over one piece per request (a piece sees the request's K/V
        from earlier rounds, so a request's pieces never share a round)."""
        for round_ in catch_up_rounds(states, self.max_batch_tokens):
            self._run_round(requests, states, round_)

    def _run_round(self, requests: Sequence[Request], states: dict[int, HeadState], pieces) -> None:
        ids, hidden, positions, segments, lengths = [], [], [], [], []
        for i, start, rows in pieces:
            st = states[i]
            st.next_pos = max(st.next_pos, start)  # a gap: positions without tap states
            n = rows.shape[0]
            ids += requests[i].all_token_ids[start + 1:start + 1 + n]
            positions += range(start, start + n)
            hidden.append(rows)
            st.reserve(n)
            segments.append((st, st.n, n))
            lengths.append(n)
        aux = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        with intra_op_threads(self._threads if sum(lengths) > SMALL_WORK else 1):
            h, logits, greedy = self._forward(ids, aux.to(device=self.device, dtype=self.dtype).contiguous(),
                                              positions, segments, fuse=True)
        self.num_catchup_tokens += sum(lengths)
        for r, (i, start, rows) in enumerate(pieces):
            st = states[i]
            n = rows.shape[0]
            st.n += n
            st.next_pos = start + n
            st.last_pos, st.last_h, st.last_logits = start + n - 1, h[r], logits[r]
            st.last_greedy = None if greedy is None else greedy[r]

    def _forward(self, ids: list[int], states: torch.Tensor, positions: list[int],
                 segments: list[tuple[HeadState, int, int]], fuse: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """One head forward over rows with input tokens ``ids`` at ``positions``, from ``states``:
        the target's tap states (``fuse``: a catch-up) or the previous draft step's outputs. Rows
        come in ``segments`` (``(state, at, n)``: the next ``n`` rows are that request's, their K/V
        go to its rows ``[at, at + n)``): every row's K/V is written, and each segment's last row
        gives its output: (pre-norm ``h``, draft logits, greedy draft as a target id or None), in
        the C call or the head's torch forward."""
        if self.cpu_forward is not None:
            return self.cpu_forward(ids, states, positions, [(st.kv, at, n) for st, at, n in segments], fuse)
        head = self.head
        embeds = self.embed[torch.tensor(ids, dtype=torch.long, device=self.device)].to(self.dtype)
        hidden = head.fuse(states) if fuse else states
        pos = torch.tensor(positions, device=self.device)
        lengths = [n for _, _, n in segments]
        if len(lengths) == len(ids):  # one row each (a draft step): every row has a reader
            h, logits = head(embeds, hidden, pos, segment_attend(segments))
            return h, logits, None
        last_rows = torch.tensor(lengths).cumsum(0) - 1
        h, logits = head(embeds, hidden, pos, segment_attend(segments, last_only=True),
                         out_rows=last_rows.to(self.device))
        return h, logits, None

    def _new_state(self) -> HeadState:
        c = self.head.config
        return HeadState.empty(c.num_key_value_heads, c.head_dim, self.dtype, self.device)


SMALL_WORK = 16  # requests (draft steps) or catch-up rows up to which the head runs on one CPU thread

