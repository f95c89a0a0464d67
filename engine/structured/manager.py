"""Per-request grammar state inside the engine's step transaction.

The invariant: between steps, a request's matcher has consumed exactly its committed output
tokens. Everything else follows from it.

* ``trim_drafts`` (after ``propose``): a request's drafts are cut at the first token its grammar
  forbids, since verification would reject it anyway. Only fewer drafts: no effect on the output.
* ``apply_masks`` (row preparation, after the forward pass): row j of a (1 + k)-row verify is
  masked with the grammar state advanced through ``drafts[:j]``, exactly the state plain decoding
  would have there if those drafts were accepted. A draft the grammar forbids has logit ``-inf``
  at its row, so the verify rejects it like any other draft the target would not produce; the
  rows after it are never read (the row of the rejected draft emits the recovered token) and stay
  unmasked; so do the rows after a draft that completes the grammar (the request ends at that
  draft). The matcher is rolled back to the committed state before returning (also on error).
* ``prepare(plan)`` (before the output processor): the step's new tokens are checked against the
  grammar, then consumed, and journaled. A request whose grammar is complete after some token
  (nothing but EOS may follow) finishes there with ``finish_reason="stop"``; tokens after it
  (a bonus EOS) are dropped, so speculative and plain decoding commit the same tokens. A token
  the grammar forbids cannot be sampled; if it is (a bug, or ``min_tokens`` banning the only
  legal token, EOS), the step raises and the engine's isolation ends that request.
* ``rollback()`` undoes ``prepare``; ``commit(plan)`` keeps it, rolling back the tokens a later
  stage of the step dropped (a stop string cut the output; that request finishes anyway).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from tokenbudget.api.grammar_source import grammar_source
from tokenbudget.engine.structured.backend import GrammarBackend, GrammarMatcher
from tokenbudget.engine.structured.bitmask import apply_bitmask
from tokenbudget.engine.structured.llguidance_backend import load_backend
from tokenbudget.scheduler.drafts import DraftBatch
from tokenbudget.scheduler.output import EngineCoreOutput
from tokenbudget.scheduler.request import Request, RequestStatus
from tokenbudget.scheduler.stop import end_at


class StructuredOutputs:
    """The engine's grammar states; ``tokenizer`` None means structured requests are refused."""

    def __init__(self, tokenizer=None, vocab_size: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: GrammarBackend | None = None  # built on first use (~0.3 s on a 49k vocabulary)
        self.matchers: dict[str, GrammarMatcher] = {}
        self._journal: list[tuple[str, GrammarMatcher, int]] = []
        self.mask_seconds = 0.0  # time spent computing and applying masks (benches read it)
        self.mask_rows = 0

    # ---- requests (between steps)
    def compile(self, request: Request) -> GrammarMatcher | None:
        """The request's matcher, or None when it has no structured output; ValueError naming
        ``structured_outputs`` when the grammar cannot be used. Changes nothing."""
        params = getattr(request.sampling_params, "structured_outputs", None)
        if params is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs an engine with a tokenizer")
        if self._backend is None:
            self._backend = load_backend(self.tokenizer, self.vocab_size)
        return self._backend.matcher(grammar_source(params))

    def add(self, request_id: str, matcher: GrammarMatcher | None) -> None:
        if matcher is not None:
            self.matchers[request_id] = matcher

    def on_finished(self, request: Request) -> None:
        self.matchers.pop(request.request_id, None)

    # ---- one step
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

    def apply_masks(self, logits: torch.Tensor, rows) -> None:
        """In place: mask every verify row of the structured requests (see the module docstring).
        ``rows``: per sampling request, ``(first_row, num_rows, scheduled_request)``."""
        if not self.matchers:
            return
        start = time.perf_counter()
        width = self._backend.bitmask_width
        for first, m, sr in rows:
            matcher = self.matchers.get(sr.request_id)
            if matcher is None:
                continue
            drafts = sr.spec_token_ids[:m - 1]
            n = matcher.num_legal(drafts)
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
            finally:
                matcher.rollback(consumed)
            apply_bitmask(logits, first, bitmask[:consumed + 1])
            self.mask_rows += consumed + 1
        self.mask_seconds += time.perf_counter() - start

    def prepare(self, plan: list[EngineCoreOutput]) -> None:
        """Consume the step's tokens (journaled); end requests whose grammar is complete."""
        for entry in plan:
            matcher = self.matchers.get(entry.request_id)
            tokens = entry.new_token_ids
            if matcher is None or not tokens:
                continue
            n = matcher.num_legal(tokens)
            if n < len(tokens):
                raise RuntimeError(f"{entry.request_id}: token {tokens[n]} breaks its structured output "
                                   f"(is min_tokens banning EOS where only EOS is legal?)")
            keep = len(tokens)
            for i, token in enumerate(tokens):
                matcher.consume((token,))
                self._journal.append((entry.request_id, matcher, 1))
                if matcher.is_complete():
                    keep = i + 1
                    break
            if matcher.is_complete():
                _finish(entry, keep)

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


def _finish(entry: EngineCoreOutput, keep: int) -> None:
    """End ``entry``'s request after its first ``keep`` tokens: the grammar is complete (a stop
    token that ended it at that same token stays its reason)."""
    if keep < len(entry.new_token_ids) or entry.finish_status != RequestStatus.FINISHED_STOPPED:
        end_at(entry, keep, RequestStatus.FINISHED_STOPPED, None)
