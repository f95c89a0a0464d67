"""Per-request grammar state inside the engine's step transaction.

The invariant: between steps, a request's matcher has consumed exactly its committed output
tokens. Everything else follows from it.

* ``compile`` (admission, in the caller's thread, off the step loop): the matcher, refused with a
  ``ValueError`` naming ``structured_outputs`` when it cannot be built on this vocabulary, cannot
  produce a first token (the JSON schema ``{"$ref": "#"}``), is too complex for llguidance's
  limits one token in (a schema of 5000 optional properties: the probe consumes the first legal
  token and rolls it back), or its first mask alone costs more than ``FIRST_MASK_ALLOWANCE``
  per-step mask budgets.
* ``trim_drafts`` (after ``propose``): a request's drafts are cut at the first token its grammar
  forbids, since verification would reject it anyway. Only fewer drafts: no effect on the output.
* ``grammar_bitmask(sched)`` (the core, after ``schedule()``, before the forward): the masks of
  every sampling row, carried in ``SchedulerOutput.grammar_bitmask`` for the runner to apply.
  Row j of a (1 + k)-row verify is masked with the grammar state advanced through
  ``drafts[:j]``, exactly the state plain decoding would have there if those drafts were accepted.
  A draft the grammar forbids has logit ``-inf`` at its row, so the verify rejects it like any
  other draft the target would not produce; the rows after it are never read (the row of the
  rejected draft emits the recovered token) and stay unmasked; so do the rows after a draft that
  completes the grammar (the request ends at that draft). The matcher is rolled back to the
  committed state before returning (also on error). A request whose mask cannot be computed
  (matcher error, a row that allows no token) or whose masks cost more than ``max_mask_ms`` of
  CPU time in the step is a ``RequestFault``: it ends alone, before the forward, and one
  request's grammar never holds the batch up for longer than that budget. The masks of all
  requests together stay within the step's budget (``mask_budget``: ``plan_step`` leaves out of
  the step the requests whose share is used up; past the budget anyway, ``MaskDeferral``).
* ``prepare(plan)`` (before the output processor): the step's new tokens are checked against the
  grammar, then consumed, and journaled. A request whose grammar is complete after some token
  (nothing but EOS may follow) finishes there with ``finish_reason="stop"``; tokens after it
  (a bonus EOS) are dropped, so speculative and plain decoding commit the same tokens. A token
  the grammar forbids cannot be sampled; if it is (``min_tokens`` banning the only legal token,
  EOS) or the grammar refuses to go on (a resource limit), that request's ``RequestFault``.
* ``rollback()`` undoes ``prepare``; ``commit(plan)`` keeps it, rolling back the tokens a later
  stage of the step dropped (a stop string cut the output; that request finishes anyway). The
  matchers are the one per-request state that cannot be a record of its ``RequestTable``: each
  is llguidance's native parser state, advanced by ``consume`` and undone by ``rollback(n)``, with
  no cheap copy; so this journal of consumed tokens is kept beside the table (which only says
  which request has which matcher, and is released with the request).

Mask cost: wall-clock limits would fail requests on a busy machine, so the budget is the CPU time
of the thread computing the masks (``time.thread_time``), which does not grow when the process
waits for a core.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from tokenbudget.api.grammar_source import grammar_source
from tokenbudget.engine.structured.backend import GrammarBackend, GrammarMatcher
from tokenbudget.engine.structured.llguidance_backend import load_backend
from tokenbudget.engine.structured.mask_budget import MaskBudget, MaskDeferral
from tokenbudget.request_table import RequestTable
from tokenbudget.scheduler.drafts import DraftBatch
from tokenbudget.scheduler.output import EngineCoreOutput, SchedulerOutput
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.request_fault import RequestFault, short
from tokenbudget.scheduler.stop import end_at

DEFAULT_MAX_MASK_MS = 10.0
DEFAULT_MAX_BATCH_MASK_MS = 5.0
# The first mask builds the lexer's caches (up to ~7 ms for an ordinary schema on a 49k vocabulary,
# benches/RESULTS.md) and is paid once, off the step loop: it may take this many per-step budgets.
FIRST_MASK_ALLOWANCE = 10


class StructuredOutputs:
    """The engine's grammar states; ``tokenizer`` None means structured requests are refused."""

    def __init__(self, tokenizer=None, vocab_size: int = 0, max_mask_ms: float = DEFAULT_MAX_MASK_MS,
                 max_batch_mask_ms: float = DEFAULT_MAX_BATCH_MASK_MS) -> None:
        if not max_mask_ms > 0:
            raise ValueError(f"max_mask_ms must be > 0, got {max_mask_ms!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_mask_seconds = max_mask_ms / 1000.0  # CPU time one request's masks may take per step
        self.budget = MaskBudget(max_batch_mask_ms / 1000.0)  # CPU time all masks of a step may take
        self._step_masks: dict[str, tuple[list[int], np.ndarray]] = {}  # this step's, kept across its attempts
        self._backend: GrammarBackend | None = None  # built on first use (~0.3 s on a 49k vocabulary)
        self._backend_lock = threading.Lock()
        self.matchers: RequestTable[GrammarMatcher] = RequestTable("grammar matchers")
        self._journal: list[tuple[str, GrammarMatcher, int]] = []
        self.mask_seconds = 0.0  # time spent computing and applying masks (benches read it)
        self.mask_rows = 0

    # ---- requests (between steps)
    def compile(self, request: Request) -> GrammarMatcher | None:
        """The request's matcher, or None when it has no structured output; ValueError naming
        ``structured_outputs`` when the grammar cannot be used (see the module docstring).
        Changes nothing; safe to call from any thread."""
        params = getattr(request.sampling_params, "structured_outputs", None)
        if params is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs an engine with a tokenizer")
        backend = self._load_backend()
        matcher = backend.matcher(grammar_source(params))
        first = np.zeros(backend.bitmask_width, dtype=np.int32)
        start = time.thread_time()
        matcher.fill_bitmask(first)
        spent = time.thread_time() - start
        error = matcher.error()
        if error is not None or not first.any():
            raise ValueError(f"structured_outputs: the grammar cannot produce a first token"
                             f"{': ' + short(error, 200) if error else ''}")
        error = _probe_first_token(matcher, first)
        if error is not None:
            raise ValueError(f"structured_outputs: the grammar is too complex: {short(error, 200)}")
        if spent > FIRST_MASK_ALLOWANCE * self.max_mask_seconds:
            raise ValueError(f"structured_outputs: the grammar is too costly: its first mask took "
                             f"{spent * 1e3:.0f} ms of CPU, more than the "
                             f"{FIRST_MASK_ALLOWANCE * self.max_mask_seconds * 1e3:g} ms allowed")
        matcher.cost = spent  # the estimate of its masks until the first step measures one
        return matcher

    def _load_backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = load_backend(self.tokenizer, self.vocab_size)
            return self._backend

    def take(self, request: Request, copy: bool = False) -> GrammarMatcher | None:
        """The matcher for a request being admitted: the one compiled before ``add_request``
        (``request.grammar``; a copy of it for the second and later children of an ``n > 1``
        request), else compiled now."""
        matcher = request.grammar
        if matcher is None:
            return self.compile(request)
        return matcher.copy() if copy else matcher

    def add(self, request_id: str, matcher: GrammarMatcher | None) -> None:
        if matcher is not None:
            self.matchers.set(request_id, matcher)

    @property
    def tables(self) -> tuple[RequestTable, ...]:
        return (self.matchers,)

    def forget(self, request_id: str) -> None:
        """A finished request's share of the mask budget (accounting across steps, not step state:
        nothing to roll back, so it lives outside the tables)."""
        self.budget.forget(request_id)

    # ---- one step
    def plan_step(self, num_requests: int) -> frozenset[str]:
        """At the start of a step with ``num_requests`` requests in flight: the structured ones
        that wait this step, their share of the step's mask budget used up (``mask_budget``);
        usually none."""
        self._step_masks.clear()
        if not self.matchers:
            return frozenset()
        return self.budget.defer({rid: matcher.cost for rid, matcher in self.matchers.items()},
                                 alone=num_requests <= len(self.matchers))

    def trim_drafts(self, batch: DraftBatch) -> DraftBatch:
        """``batch`` with each structured request's drafts cut before their first illegal token."""
        if not self.matchers:
            return batch
        tokens, probs, changed = list(batch.token_ids), None if batch.probs is None else list(batch.probs), False
        for i, rid in enumerate(batch.request_ids):
            matcher = self.matchers.get(rid)
            if matcher is None or not tokens[i]:
                continue
            n = matcher.num_legal(tokens[i])
            if n < len(tokens[i]):
                changed = True
                tokens[i] = tokens[i][:n]
                if probs is not None and probs[i] is not None:
                    probs[i] = probs[i][:n] if n else None
        return DraftBatch(batch.request_ids, tokens, probs) if changed else batch

    def grammar_bitmask(self, sched: SchedulerOutput) -> dict[str, np.ndarray] | None:
        """The masks of the step's sampling rows (``SchedulerOutput.grammar_bitmask``); raises
        ``RequestFault`` naming every request whose masks fail or exceed the budget, then
        ``MaskDeferral`` naming those left once the step's budget is spent (masks made are kept
        for the step's next attempt). The matchers are back in their committed state when it
        returns or raises."""
        if not self.matchers:
            return None
        wall = time.perf_counter()
        width = self._backend.bitmask_width
        masks: dict[str, np.ndarray] = {}
        faults: dict[str, str] = {}
        late: list[str] = []  # past the step's budget: they wait (MaskDeferral)
        spent_in_step = 0.0
        for sr in sched.scheduled:
            rid = sr.request_id
            matcher = self.matchers.get(rid)
            if matcher is None or not sr.needs_sample:
                continue
            made = self._step_masks.get(rid)
            if made is not None and made[0] == sr.spec_token_ids:  # an earlier attempt of this step made it
                masks[rid] = made[1]
                continue
            if spent_in_step > self.budget.seconds:
                late.append(rid)
                continue
            start = time.thread_time()
            try:
                masks[rid] = _verify_rows(matcher, sr.spec_token_ids, width)
            except _GrammarStuck as exc:
                faults[rid] = f"structured_outputs: {exc}"
                continue
            spent = time.thread_time() - start
            spent_in_step += spent
            matcher.cost = max(spent, matcher.cost / 2)
            self.budget.charge(rid, spent)
            if spent > self.max_mask_seconds:
                faults[rid] = (f"structured_outputs: the grammar's masks took {spent * 1e3:.0f} ms of CPU "
                               f"in one step, more than the {self.max_mask_seconds * 1e3:g} ms allowed")
                continue
            self._step_masks[rid] = (list(sr.spec_token_ids), masks[rid])
            self.mask_rows += len(masks[rid])
        self.mask_seconds += time.perf_counter() - wall
        if faults:
            raise RequestFault(faults)
        if late:
            raise MaskDeferral(late)
        return masks or None

    def prepare(self, plan: list[EngineCoreOutput]) -> None:
        """Consume the step's tokens (journaled); end requests whose grammar is complete.
        ``RequestFault`` naming the requests whose grammar refuses their tokens."""
        faults: dict[str, str] = {}
        for entry in plan:
            matcher = self.matchers.get(entry.request_id)
            tokens = entry.new_token_ids
            if matcher is None or not tokens:
                continue
            n = matcher.num_legal(tokens)
            if n < len(tokens):
                error = matcher.error()
                faults[entry.request_id] = (f"structured_outputs: {short(error, 200)}" if error else
                                            f"structured_outputs: token {tokens[n]} breaks the grammar "
                                            f"(is min_tokens banning EOS where only EOS is legal?)")
                continue
            keep = len(tokens)
            try:
                for i, token in enumerate(tokens):
                    matcher.consume((token,))
                    self._journal.append((entry.request_id, matcher, 1))
                    if matcher.is_complete():
                        keep = i + 1
                        break
            except RuntimeError as exc:  # the grammar refused a token it had validated (a limit)
                faults[entry.request_id] = f"structured_outputs: {short(exc, 200)}"
                continue
            if matcher.is_complete():
                _finish(entry, keep)
        if faults:
            raise RequestFault(faults)

    def rollback(self) -> None:
        journal, self._journal = self._journal, []
        for _, matcher, n in reversed(journal):
            matcher.rollback(n)

    def commit(self, plan: list[EngineCoreOutput]) -> None:
        """Keep this step's tokens; give back any a later stage of the step dropped."""
        consumed: dict[str, int] = {}
        for rid, _, n in self._journal:
            consumed[rid] = consumed.get(rid, 0) + n
        self._journal = []
        for entry in plan:
            extra = consumed.get(entry.request_id, 0) - len(entry.new_token_ids)
            if extra > 0:
                self.matchers[entry.request_id].rollback(extra)


class _GrammarStuck(Exception):
    """A matcher cannot give a mask: its request's fault."""


def _probe_first_token(matcher: GrammarMatcher, first: np.ndarray) -> str | None:
    """Consume the first legal token and roll it back; the matcher's error if it fails there."""
    word = int(np.flatnonzero(first)[0])
    bits = int(first[word]) & 0xFFFFFFFF
    token = word * 32 + (bits & -bits).bit_length() - 1
    try:
        matcher.consume((token,))
    except RuntimeError as exc:
        return matcher.error() or str(exc)
    error = matcher.error()
    if error is None:
        matcher.rollback(1)
    return error


def _verify_rows(matcher: GrammarMatcher, drafts: list[int], width: int) -> np.ndarray:
    """The bitmask rows of one sampling request: row 0 in the committed state, row j after
    ``drafts[:j]``, up to the first illegal draft or the draft that completes the grammar."""
    n = matcher.num_legal(drafts) if drafts else 0
    bitmask = np.zeros((n + 1, width), dtype=np.int32)
    consumed = 0
    try:
        matcher.fill_bitmask(bitmask[0])
        # A complete grammar consumes nothing more: the request ends at the token that
        # completed it, so later rows (EOS-only until then) are never read.
        while consumed < n and not matcher.is_complete():
            matcher.consume(drafts[consumed:consumed + 1])
            consumed += 1
            matcher.fill_bitmask(bitmask[consumed])
        error = matcher.error()
    except RuntimeError as exc:
        error = str(exc)
    finally:
        matcher.rollback(consumed)
    if error is not None:
        raise _GrammarStuck(short(error, 200))
    rows = bitmask[:consumed + 1]
    if not rows.any(axis=1).all():
        raise _GrammarStuck("the grammar allows no next token")
    return rows


def _finish(entry: EngineCoreOutput, keep: int) -> None:
    """End ``entry``'s request after its first ``keep`` tokens: the grammar is complete (a stop
    token that ended it at that same token stays its reason)."""
    if keep < len(entry.new_token_ids) or entry.finish_status != RequestStatus.FINISHED_STOPPED:
        end_at(entry, keep, RequestStatus.FINISHED_STOPPED, None)
