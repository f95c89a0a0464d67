"""The proposer interface and the clipping every proposer's drafts go through.

A proposer is called once per engine step, after ``update_from_output``, with the running
requests that are decoding: every committed token has KV except the last one
(``num_computed_tokens == len(all_token_ids) - 1``). It returns, per request, up to
``num_tokens[i]`` draft token ids; fewer (including none) is always allowed.

How many drafts are useful (``draft_limit``): verifying k drafts emits between 1 and k + 1
tokens (accepted drafts plus one bonus/recovered token). A request that has
``r = max_tokens - num_output_tokens`` tokens left therefore gains nothing from more than
``r - 1`` drafts: if all of them are accepted the bonus token already completes it. The same
holds for the model length: with ``L = len(all_token_ids)``, at most ``max_model_len - L - 1``
drafts are useful, so ``L + len(drafts) < max_model_len`` always (the drafts' KV positions stay
inside the model length, and so does the bonus token). ``Request.max_spec_tokens`` (0 = never
speculate) caps it further.

Draft probabilities: drafters that sample from a distribution (draft model, self-draft) keep
the q-distributions of their last ``propose`` call and hand them over through
``take_draft_probs``; drafters without probabilities (n-gram, suffix) return None, and the
rejection sampler then treats q(x) = 1 for the drafted token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from tokenbudget.scheduler.request import Request


@runtime_checkable
class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """For each decoding request, up to ``num_tokens[i]`` draft token ids (may be fewer)."""
        ...

    def on_request_finished(self, request: Request) -> None:
        """Called once when a request finishes or is aborted (e.g. to feed a global cache)."""
        ...

    def take_draft_probs(self) -> list[Any] | None:
        """q-distributions ([n_i, vocab] each) of the last ``propose`` call, or None."""
        ...


class BaseProposer:
    """Defaults for proposers without probabilities and without per-request state."""

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        raise NotImplementedError

    def on_request_finished(self, request: Request) -> None:
        return None

    def take_draft_probs(self) -> list[Any] | None:
        return None


def draft_limit(request: Request, max_model_len: int, k: int | None = None) -> int:
    """Most drafts worth proposing for ``request`` this step (>= 0); see the module docstring."""
    limit = min(max_model_len - request.num_tokens - 1,
                request.max_tokens - request.num_output_tokens - 1)
    if request.max_spec_tokens is not None:
        limit = min(limit, request.max_spec_tokens)
    if k is not None:
        limit = min(limit, k)
    return max(0, limit)


def draft_limits(requests: Sequence[Request], num_tokens: Sequence[int],
                 max_model_len: int) -> list[int]:
    """``draft_limit`` for a batch; ``num_tokens[i]`` is the controller's (or config's) k."""
    if len(requests) != len(num_tokens):
        raise ValueError(f"num_tokens has {len(num_tokens)} entries for {len(requests)} requests")
    return [draft_limit(r, max_model_len, k) for r, k in zip(requests, num_tokens)]


def clip_drafts(requests: Sequence[Request], drafts: Sequence[Sequence[int]],
                max_model_len: int, num_tokens: Sequence[int] | None = None) -> list[list[int]]:
    """Truncate each request's drafts to ``draft_limit`` (and to ``num_tokens[i]`` if given)."""
    if len(drafts) != len(requests):
        raise ValueError(f"{len(drafts)} draft lists for {len(requests)} requests")
    ks = num_tokens if num_tokens is not None else [None] * len(requests)
    return [list(d[:draft_limit(r, max_model_len, k)]) for r, d, k in zip(requests, drafts, ks)]


@dataclass(slots=True)
class ProposalBatch:
    """One step's drafts: ``token_ids[i]`` for ``requests[i]``; ``draft_probs`` None or one
    [len(token_ids[i]), vocab] tensor per request."""

    token_ids: list[list[int]]
    draft_probs: list[Any] | None = None
    request_ids: list[str] = field(default_factory=list)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def clipped(self, requests: Sequence[Request], max_model_len: int,
                num_tokens: Sequence[int] | None = None) -> ProposalBatch:
        """A copy with every draft list (and its probabilities) cut to ``draft_limit``."""
        ids = clip_drafts(requests, self.token_ids, max_model_len, num_tokens)
        probs = None
        if self.draft_probs is not None:
            probs = [p[: len(t)] for p, t in zip(self.draft_probs, ids)]
        return ProposalBatch(ids, probs, [r.request_id for r in requests])


def propose_clipped(proposer: Proposer, requests: Sequence[Request], num_tokens: Sequence[int],
                    max_model_len: int) -> ProposalBatch:
    """Ask ``proposer`` for at most the useful number of drafts and clip what comes back."""
    limits = draft_limits(requests, num_tokens, max_model_len)
    batch = ProposalBatch(proposer.propose(requests, limits), proposer.take_draft_probs(),
                          [r.request_id for r in requests])
    return batch.clipped(requests, max_model_len, limits)
