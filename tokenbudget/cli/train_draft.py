"""``tokenbudget train-draft``: train an EAGLE-3 draft head for a target (training.pipeline)."""

from __future__ import annotations

import argparse
import shlex
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-draft", help="train an EAGLE-3 draft head for a model (self-distilled, resumable)",
        description="Generate prompts and the target's own responses, record its tap states, train an "
                    "EAGLE-3 head with the training-time test, export it and measure held-out acceptance. "
                    "Every stage is cached under --work-dir: rerunning resumes.")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    p.add_argument("--work-dir", default="train-draft-work", help="stage outputs and checkpoints")
    p.add_argument("--out", default=None, help="export directory for the head (default: WORK_DIR/head)")
    p.add_argument("--train-prompts", type=int, default=6000)
    p.add_argument("--heldout-prompts", type=int, default=100)
    p.add_argument("--self-written", type=float, default=0.5, help="share of prompts the target writes itself")
    p.add_argument("--max-tokens", type=int, default=192, help="response length cap")
    p.add_argument("--max-len", type=int, default=512, help="prompt + response tokens kept per conversation")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--ttt-steps", type=int, default=4, help="training-time test unroll length")
    p.add_argument("--epochs", type=float, default=6.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--eval-k", type=int, default=4, help="draft length of the held-out evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto",
                   help="matmuls of the tap-state forward and of training: auto (bfloat16 where the CPU has "
                        "native bfloat16: AVX512-BF16, AMX; else float32), bfloat16 or float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenbudget.training.pipeline import PipelineConfig, run_pipeline
    from tokenbudget.training.train import TrainConfig

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    cfg = PipelineConfig(
        model=args.model, work_dir=args.work_dir, out=args.out, train_prompts=args.train_prompts,
        heldout_prompts=args.heldout_prompts, self_written=args.self_written, max_tokens=args.max_tokens,
        max_len=args.max_len, draft_vocab=args.draft_vocab, intermediate_size=args.intermediate_size,
        eval_k=args.eval_k, seed=args.seed, precision=args.precision,
        train=TrainConfig(ttt_steps=args.ttt_steps, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                          seed=args.seed))
    result = run_pipeline(cfg, "tokenbudget " + shlex.join(sys.argv[1:]), use_tqdm=not args.no_progress)
    s = result["all"]
    print(f"held-out: tau {s.get('tau')} at k={cfg.eval_k}, accept by position {s.get('accept_at_position')}")
    return 0
