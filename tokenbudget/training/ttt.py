"""EAGLE-3's training-time test: the head unrolled for k steps over a batch of conversations.

Row ``i`` of a conversation is a draft chain that starts where the target has verified position
``i`` (its tap states ``aux[i]``) and sampled token ``x[i+1]``. Step ``j`` of that chain runs at
position ``i + j``, reads ``embed(x[i+j+1])`` and, as ``hidden``, ``fc(aux[i])`` at step 0 or the
head's own pre-norm output of step ``j-1`` of the same chain, and predicts ``x[i+j+2]``.

The attention mask is what the engine gives the head when it drafts after verifying position
``i``: its cache holds the entries written from the target's states for positions ``0..i`` (step 0
of rows ``0..i``: causal) plus its own entries for this chain's earlier steps (step ``m`` of row
``i`` for ``1 <= m <= j``: one diagonal per step). The token fed at step ``j >= 1`` is the true
``x[i+j+1]``: a draft only counts when every earlier draft of its chain was accepted, that is when
the head's own token equals the true one, so the two agree wherever it matters.

Steps ``j >= 1`` only run for the rows that carry a loss (response positions): other rows' later
steps are never attended to by anyone, so leaving them out changes nothing but the cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenbudget.engine.model.eagle3 import Eagle3Head


class _ChainAttention:
    """The ``attend`` of one unrolled batch: keeps each step's k/v (dense ``[B, kv, T, D]``)."""

    def __init__(self, batch: int, length: int, rows: torch.Tensor | None):
        self.b, self.t, self.rows = batch, length, rows
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of this step -> ``[B, heads, T, D]`` (zeros where the step did not run)."""
        if self.rows is not None:
            full = x.new_zeros(self.b * self.t, *x.shape[1:])
            x = full.index_copy(0, self.rows, x)
        return x.view(self.b, self.t, *x.shape[1:]).transpose(1, 2)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads, d = q.shape[1], q.shape[2]
        rep = heads // k.shape[1]
        q, k, v = self._dense(q), self._dense(k), self._dense(v)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        self.keys.append(k)
        self.values.append(v)
        scale = d ** -0.5
        scores = (q @ self.keys[0].transpose(-1, -2)) * scale
        causal = torch.ones(self.t, self.t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in self.keys[1:]]
        probs = torch.cat([scores, *diag], dim=-1).softmax(-1)
        out = probs[..., :self.t] @ self.values[0]
        for m, vv in enumerate(self.values[1:]):
            out = out + probs[..., self.t + m:self.t + m + 1] * vv
        out = out.transpose(1, 2).reshape(self.b * self.t, heads * d)
        return out if self.rows is None else out.index_select(0, self.rows)


def unroll(head: Eagle3Head, embed: torch.Tensor, aux: torch.Tensor, tokens: torch.Tensor,
           rows: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``aux [B, T, 3H_t]``, ``tokens [B, T]`` (right-padded), ``rows``: flat indices ``b * T + i``
    of the chains to unroll past step 0. Returns, per step ``j``, draft logits ``[len(rows),
    V_draft]`` predicting ``x[i+j+2]``."""
    b, t = tokens.shape
    pad = tokens.new_zeros(b, steps + 1)
    ahead = torch.cat([tokens, pad], dim=1)
    positions = torch.arange(t, device=tokens.device).repeat(b)
    attend0 = _ChainAttention(b, t, None)
    hidden = head.fuse(aux.reshape(b * t, -1).to(head.fc.weight.dtype))
    inputs = F.embedding(ahead[:, 1:t + 1].reshape(-1), embed)
    hidden, logits = head(inputs, hidden, positions, attend0)
    out = [logits.index_select(0, rows)]
    hidden = hidden.index_select(0, rows)
    chain = _ChainAttention(b, t, rows)
    chain.keys, chain.values = attend0.keys, attend0.values
    for j in range(1, steps):
        inputs = F.embedding(ahead[:, j + 1:t + j + 1].reshape(-1).index_select(0, rows), embed)
        hidden, logits = head(inputs, hidden, positions.index_select(0, rows) + j, chain)
        out.append(logits)
    return out


def chain_labels(tokens: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, steps: int) -> torch.Tensor:
    """Target ids ``[steps, len(rows)]``: ``x[i+j+2]`` for row ``i``, step ``j``; -1 past the end."""
    b, t = tokens.shape
    ahead = torch.cat([tokens, tokens.new_full((b, steps + 2), -1)], dim=1)
    bi, ii = rows // t, rows % t
    out = []
    for j in range(steps):
        lab = ahead[bi, ii + j + 2]
        lab = torch.where(ii + j + 2 < lengths[bi], lab, torch.full_like(lab, -1))
        out.append(lab)
    return torch.stack(out)
