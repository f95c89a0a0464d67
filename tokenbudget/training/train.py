"""Stage 5: train the head with the training-time test; checkpoints make it resumable.

The head starts from the target's own maps where they exist: ``lm_head`` = the target's output
embedding rows of the draft vocabulary, ``norm`` = the target's final norm; ``fc`` passes the
highest tap through (identity block, zeros elsewhere) and the layer's output projections start
small, so the layer begins close to the identity on that state. (The highest tap's logit lens
predicts the token the head is *given*, not the next one, so this is a starting point, not a
shortcut; on a 100-conversation trial it still beat a random ``fc`` at every draft position.)

Loss: cross-entropy of each unrolled step against the target's greedy token (the response token,
mapped into the draft vocabulary; tokens outside it carry no loss), weighted 0.8^j over steps as
in the SpecForge recipe.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable

import msgspec
import torch
import torch.nn.functional as F

from tokenbudget.engine.model.config import ModelConfig
from tokenbudget.engine.model.eagle3 import Eagle3Config, Eagle3Head
from tokenbudget.training.features import FeatureSet
from tokenbudget.training.precision import autocast
from tokenbudget.training.ttt import chain_labels, unroll


class TrainConfig(msgspec.Struct, frozen=True, kw_only=True):
    ttt_steps: int = 4
    epochs: float = 6.0
    lr: float = 2e-3
    warmup: int = 20
    batch_tokens: int = 4096
    step_decay: float = 0.8
    seed: int = 0
    checkpoint_seconds: float = 300.0


def new_head(target: ModelConfig, taps: tuple[int, int, int], draft_ids: torch.Tensor, intermediate: int,
             state: dict[str, torch.Tensor], seed: int = 0) -> Eagle3Head:
    """A head shaped after the target's attention, initialised from the target (module doc)."""
    torch.manual_seed(seed)
    c = Eagle3Config(hidden_size=target.hidden_size, target_hidden_size=target.hidden_size,
                     num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                     head_dim=target.resolved_head_dim, intermediate_size=intermediate,
                     vocab_size=target.vocab_size, draft_vocab_size=int(draft_ids.numel()), aux_layer_ids=taps,
                     rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                     max_position_embeddings=target.max_position_embeddings)
    head = Eagle3Head(c)
    head.set_draft_vocab(draft_ids)
    out_embed = state.get("lm_head.weight", state["model.embed_tokens.weight"]).float()
    h = c.hidden_size
    with torch.no_grad():
        head.lm_head.weight.copy_(out_embed[head.to_target_ids(torch.arange(c.draft_vocab_size))])
        head.norm.weight.copy_(state["model.norm.weight"].float())
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * h:3 * h].copy_(torch.eye(h))
        head.midlayer.self_attn.o_proj.weight.mul_(0.1)
        head.midlayer.mlp.down_proj.weight.mul_(0.1)
    return head


def length_batches(fs: FeatureSet, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Conversations grouped by length (padded size <= ``batch_tokens``), batches shuffled."""
    order = sorted(range(len(fs)), key=lambda i: (fs.length(i), rng.random()))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * fs.length(i) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(fs: FeatureSet, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(aux [B, T, 3H_t] float32, tokens [B, T], lengths [B], rows): rows are the flat indices
    ``b * T + i`` of the chains that start at a response position (``i >= prompt_len - 1``) and
    have at least one label (``i + 2 < length``)."""
    lens = [fs.length(i) for i in idx]
    t = max(lens)
    aux = torch.zeros(len(idx), t, fs.aux.shape[1])
    tokens = torch.zeros(len(idx), t, dtype=torch.int64)
    rows = []
    for b, i in enumerate(idx):
        s, n = int(fs.offsets[i]), lens[b]
        aux[b, :n] = fs.aux[s:s + n].float()
        tokens[b, :n] = fs.tokens[s:s + n]
        first = max(int(fs.prompt_lens[i]) - 1, 0)
        rows.append(torch.arange(first, max(n - 2, first)) + b * t)
    return aux, tokens, torch.tensor(lens), torch.cat(rows)


def chain_loss(head: Eagle3Head, embed: torch.Tensor, t2d: torch.Tensor, batch, steps: int, decay: float
               ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(weighted loss, per step (correct, counted)) for one collated batch."""
    aux, tokens, lengths, rows = batch
    logits = unroll(head, embed, aux, tokens, rows, steps)
    labels = chain_labels(tokens, lengths, rows, steps)
    loss = aux.new_zeros(())
    stats = []
    for j, lg in enumerate(logits):
        lab = labels[j]
        d = torch.where(lab >= 0, t2d[lab.clamp(min=0)], torch.full_like(lab, -1))
        ok = d >= 0
        if ok.any():
            loss = loss + decay ** j * F.cross_entropy(lg[ok], d[ok])
        stats.append((int((lg.argmax(-1) == d)[ok].sum()), int((lab >= 0).sum())))
    return loss, stats


def train(head: Eagle3Head, embed: torch.Tensor, fs: FeatureSet, cfg: TrainConfig, ckpt_path: str,
          on_checkpoint: Callable[[Eagle3Head], None] | None = None, use_tqdm: bool = True,
          precision: str = "float32") -> dict:
    """Train ``head`` in place; resumes from ``ckpt_path`` when it exists. Returns a summary.
    ``precision`` (resolved, ``training.precision``): the forward's autocast."""
    from tqdm import tqdm

    t2d = torch.full((head.config.vocab_size,), -1, dtype=torch.int64)
    t2d[head.to_target_ids(torch.arange(head.config.draft_vocab_size))] = torch.arange(head.config.draft_vocab_size)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_epoch = len(length_batches(fs, cfg.batch_tokens, random.Random(cfg.seed)))
    total = max(1, math.ceil(per_epoch * cfg.epochs))
    done, seconds = 0, 0.0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=False)
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        done, seconds = ck["done"], ck["seconds"]

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, total - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def save() -> None:
        tmp = ckpt_path + ".tmp"
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "done": done, "seconds": seconds}, tmp)
        os.replace(tmp, ckpt_path)
        if on_checkpoint is not None:
            on_checkpoint(head)

    head.train()
    bar = tqdm(total=total, initial=done, desc="Training", unit="batch", disable=not use_tqdm, dynamic_ncols=True)
    last_save, start = time.monotonic(), time.monotonic() - seconds
    window: list[list[tuple[int, int]]] = []
    while done < total:
        epoch, k = divmod(done, per_epoch)
        batches = length_batches(fs, cfg.batch_tokens, random.Random(cfg.seed + epoch))
        idx = batches[k]
        for g in opt.param_groups:
            g["lr"] = lr_at(done)
        with autocast(precision):
            loss, stats = chain_loss(head, embed, t2d, collate(fs, idx), cfg.ttt_steps, cfg.step_decay)
        opt.zero_grad(set_to_none=True)
        if loss.requires_grad:  # False when no chain of the batch has a label in the draft vocabulary
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
        done += 1
        seconds = time.monotonic() - start
        window = (window + [stats])[-20:]
        acc = [sum(s[j][0] for s in window) / max(1, sum(s[j][1] for s in window)) for j in range(cfg.ttt_steps)]
        bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in acc))
        bar.update(1)
        if time.monotonic() - last_save > cfg.checkpoint_seconds or done == total:
            save()
            last_save = time.monotonic()
    bar.close()
    head.eval()
    return {"batches": total, "batches_per_epoch": per_epoch, "seconds": round(seconds, 1)}
