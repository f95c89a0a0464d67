"""The EAGLE-3 head's K/V for one request, and attention over it.

``HeadState`` keeps what the drafter knows of a request (``engine.drafters.eagle3_proposer``): the
head's K/V over the positions it ran (rows ``[0, n)`` of one buffer ``[2, capacity, Hk, D]``, K
then V, the layout the C forward's attention reads; it grows by doubling; rows past ``n`` are
scratch, the draft steps' K/V), ``next_pos``, the tap rows queued for it, the last run
row's output. Rows below ``n`` are never written again and every other field is replaced, never
mutated, so a copy (``__copy__``: the same references) is the step transaction's undo record:
the states are records of the drafter's ``RequestTable``, and a step changes its own copy.

``segment_attend`` is the ``attend`` of one head forward over several requests' rows: each
request's new K/V are written into its buffer and its rows attend to its own rows below them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class HeadState:
    kv: torch.Tensor                   # [2, capacity, kv_heads, D]: K (after RoPE) then V, by position
    n: int = 0                         # rows of kv that hold run positions
    next_pos: int = 0                  # positions < next_pos: run, or without tap states
    pending: tuple = ()                # ((first position, aux rows [m, 3 * H_t]), ...) not yet run
    pending_rows: int = 0              # rows in pending (counted once, read every step)
    last_pos: int = -1                 # position of the last row run
    last_h: torch.Tensor | None = None       # its pre-norm output [H]
    last_logits: torch.Tensor | None = None  # its draft logits [V_draft]
    last_greedy: int | None = None           # their first largest, as a target id (the C forward gives it)
    tokens: list | None = None               # the request's all_token_ids (the scheduler's list, read only)

    @classmethod
    def empty(cls, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> HeadState:
        return cls(torch.zeros((2, 0, kv_heads, head_dim), dtype=dtype, device=device))

    @property
    def k(self) -> torch.Tensor:
        return self.kv[0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[1]

    def __copy__(self) -> HeadState:
        return HeadState(self.kv, self.n, self.next_pos, self.pending, self.pending_rows, self.last_pos, self.last_h,
                         self.last_logits, self.last_greedy, self.tokens)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows past ``n`` (a new buffer when full: a saved copy keeps the old one)."""
        need = self.n + rows
        if need > self.kv.shape[1]:
            cap = max(need, 2 * self.kv.shape[1], 64)
            kv = self.kv.new_empty((2, cap, *self.kv.shape[2:]))
            kv[:, :self.n] = self.kv[:, :self.n]
            self.kv = kv

    def copy_prefix(self, other: HeadState, rows: int) -> None:
        """``other``'s first ``rows`` rows as this state's run rows (a new buffer)."""
        self.kv = other.kv[:, :rows].clone(memory_format=torch.contiguous_format)
        self.n = self.next_pos = rows

    @property
    def covered(self) -> int:
        """Positions below this are run or queued."""
        if self.pending:
            start, rows = self.pending[-1]
            return start + rows.shape[0]
        return self.next_pos

    def queue(self, start: int, rows: torch.Tensor, max_rows: int) -> None:
        """Queue the tap rows of positions ``start ..`` (a committed step's), skipping the ones
        already queued or run (a recompute after preemption brings the same rows) and dropping
        the oldest past ``max_rows`` (a long stretch without drafting: a gap, like a cache hit)."""
        skip = max(0, self.covered - start)
        if skip >= rows.shape[0]:
            return
        pending = self.pending + ((start + skip, rows[skip:]),)
        total = self.pending_rows + rows.shape[0] - skip
        excess = total - max_rows
        while excess > 0:
            first, piece = pending[0]
            cut = min(excess, piece.shape[0])
            pending = ((first + cut, piece[cut:]),) + pending[1:] if cut < piece.shape[0] else pending[1:]
            excess -= cut
            total -= cut
        self.pending, self.pending_rows = pending, total


def catch_up_rounds(states: dict[int, HeadState], max_rows: int):
    """The queued tap rows of ``states`` (request index -> state, taken off their queues) in rounds
    of at most ``max_rows`` rows, one piece ``(index, start, rows)`` per request in a round (a
    piece sees its request's K/V from earlier rounds, so a request's pieces never share one)."""
    runs: list[list] = []   # [i, start, end, pieces]: contiguous pieces, concatenated once
    for i, st in states.items():
        for start, rows in st.pending:
            if runs and runs[-1][0] == i and runs[-1][2] == start:
                runs[-1][2] += rows.shape[0]
                runs[-1][3].append(rows)
            else:
                runs.append([i, start, start + rows.shape[0], [rows]])
        st.pending, st.pending_rows = (), 0
    queue = [(i, start, pieces[0] if len(pieces) == 1 else torch.cat(pieces)) for i, start, _, pieces in runs]
    while queue:
        budget, round_, later, taken = max_rows, [], [], set()
        for i, start, rows in queue:
            if budget <= 0 or i in taken:
                later.append((i, start, rows))
                continue
            n = min(rows.shape[0], budget)
            round_.append((i, start, rows[:n]))
            taken.add(i)
            budget -= n
            if n < rows.shape[0]:
                later.append((i, start + n, rows[n:]))
        queue = later
        yield round_


def segment_attend(segments, last_only: bool = False):
    """``attend`` for rows grouped by request: ``segments[s] = (state, at, n)``: the next ``n`` rows
    are that request's positions in order; their K/V are written to rows ``[at, at + n)`` of its
    buffers (reserved by the caller) and they see rows ``[0, at)`` and, causally, each other.
    ``last_only``: the queries are each segment's last row alone (``Eagle3Head.forward``'s
    ``out_rows``), which sees all ``at + n`` rows."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, row = [], 0
        for s, (st, at, n) in enumerate(segments):
            st.k[at:at + n] = k[row:row + n]
            st.v[at:at + n] = v[row:row + n]
            if last_only:
                outs.append(attention(q[s:s + 1], st.k[:at + n], st.v[:at + n], at + n - 1))
            else:
                outs.append(attention(q[row:row + n], st.k[:at + n], st.v[:at + n], at))
            row += n
        return torch.cat(outs)
    return attend


SMALL_QUERY = 64  # rows up to which attention is two small matmuls rather than SDPA


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: int) -> torch.Tensor:
    """``q [n, heads, D]`` (positions ``at .. at + n - 1``) over ``k, v [at + n, kv_heads, D]``,
    causal. Few query rows (every draft step, a verify's catch-up) go through two batched matmuls
    per KV head group: SDPA's CPU kernel costs milliseconds of thread start-up for one query row,
    more than the head's whole layer (benches/RESULTS.md, "Figures behind decisions in the
    source")."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    if n > SMALL_QUERY:
        mask = torch.ones((n, at + n), dtype=torch.bool, device=q.device).tril(diagonal=at)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, enable_gqa=heads != kv_heads)
        return o.transpose(0, 1).reshape(n, heads * d)
    rep = heads // kv_heads
    qg = q.view(n, kv_heads, rep, d).permute(1, 2, 0, 3).reshape(kv_heads, rep * n, d)
    scores = torch.bmm(qg, k.permute(1, 2, 0)) * d ** -0.5      # [kv_heads, rep * n, keys]
    if n > 1:
        masked = torch.ones((n, at + n), dtype=torch.bool, device=q.device).triu(diagonal=at + 1)
        scores = scores.view(kv_heads, rep, n, at + n).masked_fill(masked, float("-inf")).view_as(scores)
    o = torch.bmm(scores.softmax(dim=-1), v.transpose(0, 1))    # [kv_heads, rep * n, D]
    return o.view(kv_heads, rep, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)
