"""Stage 7: held-out acceptance of a head, the way greedy speculative decoding accepts.

For every response position ``i`` of a held-out conversation the head drafts ``k`` tokens from
the target's states at ``i`` (``ttt.unroll``: the engine's attention mask), each draft compared
with the target's greedy token there. The accepted length of a chain is its number of leading
matches (a chain is cut at the conversation's end); ``tau = 1 + mean accepted`` counts the
verify pass's own token, the tokens one target forward yields (EAGLE's acceptance length).
"""

from __future__ import annotations

import torch

from tokenbudget.engine.model.eagle3 import Eagle3Head
from tokenbudget.training.features import FeatureSet
from tokenbudget.training.train import collate
from tokenbudget.training.ttt import chain_labels, unroll


def _summary(accepted: torch.Tensor, k: int) -> dict:
    n = accepted.numel()
    if n == 0:
        return {"chains": 0}
    reach = [int((accepted >= j).sum()) for j in range(k + 1)]  # chains that reached position j
    return {"chains": n, "tau": round(1 + float(accepted.float().mean()), 3),
            "mean_accepted": round(float(accepted.float().mean()), 3),
            "accept_at_position": [round(reach[j + 1] / reach[j], 3) if reach[j] else None for j in range(k)],
            "reach_position": [round(reach[j + 1] / n, 3) for j in range(k)]}


@torch.no_grad()
def acceptance(head: Eagle3Head, embed: torch.Tensor, fs: FeatureSet, k: int = 4, batch_convs: int = 8,
               groups: list[str] | None = None) -> dict:
    """``{"all": summary, kind: summary..., group: summary...}`` (``groups``: one more label per
    conversation, e.g. how its response ended); a summary has ``tau``, ``accept_at_position``
    (P(draft j accepted | drafts before it accepted)) and ``reach_position`` (P(accepted >= j+1))."""
    head.eval()
    acc_all, convs = [], []
    for s in range(0, len(fs), batch_convs):
        idx = list(range(s, min(s + batch_convs, len(fs))))
        batch = collate(fs, idx)
        aux, tokens, lengths, rows = batch
        logits = unroll(head, embed, aux, tokens, rows, k)
        labels = chain_labels(tokens, lengths, rows, k)
        hits = torch.stack([head.to_target_ids(lg.argmax(-1)) == labels[j] for j, lg in enumerate(logits)])
        accepted = hits.int().cumprod(0).sum(0)
        acc_all.append(accepted)
        t = tokens.shape[1]
        convs += [idx[int(r) // t] for r in rows]
    accepted = torch.cat(acc_all) if acc_all else torch.zeros(0, dtype=torch.int64)
    out = {"all": _summary(accepted, k)}
    for labels in (fs.kinds, groups or []):
        for label in sorted(set(labels)):
            mask = torch.tensor([labels[c] == label for c in convs], dtype=torch.bool)
            out[label] = _summary(accepted[mask], k)
    return out
