"""Turn a SchedulerOutput into the flat-batch index tensors of one forward.

Cheap by construction: per-request Python work only (B iterations of list slicing/extends),
then one ``torch.tensor`` per list and a handful of vectorised ops for positions and slots; no
per-token Python loop. A draft-model runner reuses :func:`prepare_inputs` on the same block
tables (same positions, same slot mapping: its own KV cache, same block ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbudget.kernels.attention.base import AttentionBackend, AttentionMetadata
from tokenbudget.scheduler.output import SchedulerOutput


@dataclass(slots=True)
class InputBatch:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor   # [S] int64 rows of the flat batch whose logits are needed
    num_samples: list[int]         # per scheduled request: 1 + k when it samples, else 0
    qo_indptr: list[int]           # [B + 1]


def prepare_inputs(sched: SchedulerOutput, block_size: int, backend: AttentionBackend,
                   device: torch.device | str = "cpu") -> InputBatch:
    ids: list[int] = []
    qo_indptr = [0]
    kv_lens: list[int] = []
    block_tables: list[list[int]] = []
    flat_blocks: list[int] = []
    blk_base: list[int] = []      # per request: index into flat_blocks of block 0 of its table
    pos_shift: list[int] = []     # per request: position - flat row index
    q_lens: list[int] = []
    sample_idx: list[int] = []
    num_samples: list[int] = []
    for sr in sched.scheduled:
        n, nc = sr.num_tokens, sr.num_computed_tokens
        if n < 1 or len(sr.token_ids) != n:
            raise ValueError(f"request {sr.request_id}: num_tokens={n} but {len(sr.token_ids)} token_ids")
        start = qo_indptr[-1]
        end = start + n
        first, last = nc // block_size, (nc + n - 1) // block_size
        if last >= len(sr.block_ids):
            raise ValueError(f"request {sr.request_id}: {len(sr.block_ids)} blocks cannot hold "
                             f"positions up to {nc + n - 1} (block_size {block_size})")
        blk_base.append(len(flat_blocks) - first)
        flat_blocks.extend(sr.block_ids[first:last + 1])
        ids.extend(sr.token_ids)
        qo_indptr.append(end)
        q_lens.append(n)
        kv_lens.append(nc + n)
        pos_shift.append(nc - start)
        block_tables.append(sr.block_ids)
        if sr.needs_sample:
            m = 1 + len(sr.spec_token_ids)
            if m > n:
                raise ValueError(f"request {sr.request_id}: {m - 1} drafts but only {n} tokens scheduled")
            sample_idx.extend(range(end - m, end))
            num_samples.append(m)
        else:
            num_samples.append(0)
    t = qo_indptr[-1]
    rep = torch.tensor(q_lens)
    positions = torch.arange(t) + torch.repeat_interleave(torch.tensor(pos_shift), rep, output_size=t)
    base = torch.repeat_interleave(torch.tensor(blk_base), rep, output_size=t)
    blocks = torch.tensor(flat_blocks)[base + torch.div(positions, block_size, rounding_mode="floor")]
    slot_mapping = blocks * block_size + positions % block_size
    dev = torch.device(device)
    input_ids = torch.tensor(ids, dtype=torch.long)
    sample_indices = torch.tensor(sample_idx, dtype=torch.long)
    if dev.type != "cpu":
        input_ids, positions, slot_mapping, sample_indices = (
            x.to(dev, non_blocking=True) for x in (input_ids, positions, slot_mapping, sample_indices))
    md = backend.build_metadata(qo_indptr, kv_lens, block_tables, slot_mapping)
    return InputBatch(input_ids, positions, md, sample_indices, num_samples, qo_indptr)
