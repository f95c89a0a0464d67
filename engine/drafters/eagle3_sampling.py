"""How the EAGLE-3 drafter turns its head's draft-vocabulary logits into drafts (and q).

Plain greedy rows (no bans, bias, processors or penalties) take the argmax over the draft
vocabulary directly (the same token as the argmax of the scattered row: ``OUTSIDE`` never wins),
or the greedy draft the C forward already gave. Every other row is scattered into the target
vocabulary through ``d2t``: ids outside the draft vocabulary get ``OUTSIDE`` (finite, so a row the
request's bans leave with only non-draft ids still has a token and is never taken for a request
fault), then goes through the sampling every model drafter shares (``engine.drafters.
draft_sampling``): q for rejection sampling is the head's own distribution.
"""

from __future__ import annotations

import torch

from tokenbudget.engine.drafters.draft_sampling import sample_drafts
from tokenbudget.engine.model.eagle3 import Eagle3Head
from tokenbudget.scheduler.request import Request

OUTSIDE = -1e30  # logit of a target id outside the draft vocabulary


class HeadSampler:
    def __init__(self, head: Eagle3Head, device: torch.device) -> None:
        self.head = head
        self._target_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=device))

    def sample(self, draft_logits: torch.Tensor, requests, rows: list[int], drafts, probs,
               greedy: list[int | None] | None = None) -> None:
        """Append one draft per row (``draft_logits[r]`` belongs to request ``rows[r]``), its q row
        to ``probs[i]`` where that is a list; ``greedy[r]``: the row's greedy draft, if the
        forward gave it."""
        plain = [r for r, i in enumerate(rows) if _plain_greedy(requests[i])]
        if plain and greedy is not None and all(greedy[r] is not None for r in plain):
            for r in plain:
                drafts[rows[r]].append(greedy[r])
        elif plain:
            idx = torch.tensor(plain, dtype=torch.long, device=draft_logits.device)
            for r, t in zip(plain, self.head.to_target_ids(draft_logits[idx].argmax(dim=-1)).tolist()):
                drafts[rows[r]].append(t)
        if len(plain) == len(rows):
            return
        rest = [r for r in range(len(rows)) if r not in set(plain)]
        idx = torch.tensor(rest, dtype=torch.long, device=draft_logits.device)
        sample_drafts(self.target_logits(draft_logits[idx]), requests, [rows[r] for r in rest], drafts, probs)

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """``[T, V_draft]`` -> fp32 ``[T, V]`` (``OUTSIDE`` where the draft vocabulary has no id)."""
        out = torch.full((draft_logits.shape[0], self.head.config.vocab_size), OUTSIDE,
                         dtype=torch.float32, device=draft_logits.device)
        out[:, self._target_ids] = draft_logits.to(torch.float32)
        return out


def _plain_greedy(request: Request) -> bool:
    params = request.sampling_params
    return (params is None or (params.is_greedy and not params.needs_row_preparation)) and not request.min_tokens_banned
