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

A step is a transaction: ``propose`` runs inside it, so a proposer whose ``propose`` changes
state that outlives the step (beyond caches it can rebuild from the requests' tokens) makes that
change undoable: ``rollback`` (the step failed) undoes what the last ``propose`` did, ``commit``
(the step committed) makes it final. ``on_finished`` is called once when a request finishes or
is aborted, after its step committed.

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

Drafters that read the target's hidden states (EAGLE-3) get them in ``observe_target_states``,
called in the commit with the committed step, its plan and the runner's ``aux_hidden_states``
(the tap states of every row of the step, in the step's flat row order, or None); it must not
raise (the commit cannot fail) and only keeps what the next ``propose`` needs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        """For each decoding request, up to ``num_tokens[i]`` draft token ids (may be fewer),
        with their probabilities and kinds where the drafter has them."""
        ...

    def on_finished(self, request: Request) -> None:
        """The request finished or was aborted (free its state, feed a global cache)."""
        ...

    def observe_target_states(self, sched: Any, plan: Any, aux_hidden_states: Any) -> None:
        """The committed step's tap states (see the module doc)."""
        ...

    def commit(self) -> None:
        ...

    def rollback(self) -> None:
        ...

    def probe_cost(self, num_tokens: int) -> float | None:
        """Seconds one request's draft of ``num_tokens`` tokens costs, measured now on throw-away
        state, or None for a drafter whose drafts cost nothing (see the module doc)."""
        ...


class BaseProposer:
    """Defaults for proposers without probabilities, per-request state or undoable effects."""

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        raise NotImplementedError

    def on_finished(self, request: Request) -> None:
        return None

    def observe_target_states(self, sched: Any, plan: Any, aux_hidden_states: Any) -> None:
        return None

    def commit(self) -> None:
        return None

    def rollback(self) -> None:
        return None

    def probe_cost(self, num_tokens: int) -> float | None:
        return None
