"""The proposer interface.

A proposer is called at the start of an engine step with the running requests that are decoding
(every committed token has KV except the last one) and, per request, how many drafts to propose
at most. It returns, per request, up to that many draft token ids; fewer (including none) is
always allowed. Proposers size their drafts with ``scheduler.drafts.draft_limit``, the rule the
scheduler cuts them by.

``propose`` returns one ``Proposal``: the drafts, and with them what the drafter knows of them.
Draft probabilities: drafters that sample from a distribution (draft model, self-draft, EAGLE-3)
carry the q-distributions in ``Proposal.probs``; drafters without probabilities (n-gram, suffix)
leave it None, and the sampler then treats q(x) = 1 for the drafted token.

A step is a transaction: ``propose`` runs inside it, so a proposer keeps its per-request state
in ``RequestTable``s (``tokenbudget.request_table``) and lists them in ``tables``: the engine
core journals them with every other component's, so a failed step leaves them as they were, and
releases a finished request's records from all of them. Records are replaced, never changed in
place, except a cache the proposer rebuilds from the request's committed tokens whatever it
holds (the n-gram and suffix indexes), which a rolled-back step leaves in step with the same
committed tokens. ``on_finished`` is called once when a request finishes or is aborted, after its
step committed (suffix decoding keeps its output for later requests).

Draft kinds: a drafter that knows how a draft was found labels each request's draft
(``Proposal.kinds``: n-gram and suffix decoding, the length of the match); the
draft-length controller learns acceptance per label (``spec.adaptive``), because a draft copied
after a 4-token match is accepted far more often than one after a 2-token match (figures:
benches/RESULTS.md, "Acceptance by draft kind").

What drafting costs: a drafter that runs a model (EAGLE-3's head, a draft model, the target's
first layers) says so at start-up through
``probe_cost(k)``, the seconds one request's draft of k tokens takes, measured on throw-away
state; the draft-length controller's cost model starts from it (``engine.drafters.step_cost``)
instead of learning the drafter's cost from scratch while it over-drafts. Free drafters (n-gram,
suffix) return None.

``on_commit(step)`` is called in the commit with the ``CommittedStep``: the step, its plan, the
runner's ``aux_hidden_states`` (the tap states of every row of the step, in the step's flat row
order, or None: EAGLE-3 keeps the rows the next ``propose`` runs) and the ``receipt`` of each of
the step's proposals (what a drafter noted of its proposal, for after the commit: suffix
decoding's cached sequences that drafted become most recent). It must not raise (the commit
cannot fail).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tokenbudget.request_table import RequestTable
from tokenbudget.scheduler.request import Request


@dataclass(slots=True)
class Proposal:
    """One ``propose`` call's drafts, per request in the order asked: the draft token ids (as many
    as the drafter found, up to what it was asked for), their q-distributions (``probs``: per request
    ``[len(drafts), V]`` float32 or None; None for a drafter without probabilities) and the label of
    how each draft was found (``kinds``; None for a drafter without kinds)."""

    token_ids: list[list[int]]
    probs: list[Any] | None = None
    kinds: list[Hashable] | None = None
    receipt: Any = None  # the drafter's own note, handed back if the step commits (``CommittedStep``)


@dataclass(slots=True)
class CommittedStep:
    """What ``Proposer.on_commit`` sees of a step that committed (module doc)."""

    sched: Any  # the SchedulerOutput
    plan: Any  # the list of EngineCoreOutput
    aux_hidden_states: Any = None
    receipts: list = field(default_factory=list)  # of the step's proposals, in order; None left out


@runtime_checkable
class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        """For each decoding request, up to ``num_tokens[i]`` draft token ids (may be fewer),
        with their probabilities and kinds where the drafter has them."""
        ...

    @property
    def tables(self) -> tuple[RequestTable, ...]:
        """The proposer's per-request state (see the module doc)."""
        ...

    def on_finished(self, request: Request) -> None:
        """The request finished or was aborted, after the release of its records (feed a global cache)."""
        ...

    def on_commit(self, step: CommittedStep) -> None:
        """The step committed (see the module doc)."""
        ...

    def probe_cost(self, num_tokens: int) -> float | None:
        """Seconds one request's draft of ``num_tokens`` tokens costs, measured now on throw-away
        state, or None for a drafter whose drafts cost nothing (see the module doc)."""
        ...


class BaseProposer:
    """Defaults for proposers without per-request state, a global cache or a model to price."""

    tables: tuple[RequestTable, ...] = ()

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        raise NotImplementedError

    def on_finished(self, request: Request) -> None:
        return None

    def on_commit(self, step: CommittedStep) -> None:
        return None

    def probe_cost(self, num_tokens: int) -> float | None:
        return None
