"""``tokenbudget fuzz``: fuzz the scheduler + KV cache with the shipped Hypothesis state machine.

    tokenbudget fuzz [--examples N] [--seed S] [--config FILE] [--steps N] [--reproduce BLOB]
                     [--report] [--report-json FILE]

Exit status 0 when every invariant held, 1 after printing a shrunk failing program and the
command that replays it, 2 on bad arguments (argparse) or an unreadable/invalid config file.
``cli.main`` calls ``add_parser`` and ``run``; ``python -m tokenbudget.cli.fuzz ...``
works alone. The engine's own fault warnings are silenced during the run: the state machine
injects faults on purpose, thousands of them.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--examples", type=int, default=200, help="programs to run (default 200)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for a reproducible run (default: drawn at random and printed)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="SchedulerConfig fields as JSON or TOML (default: random small configs)")
    parser.add_argument("--steps", type=int, default=50, help="most rules per program (default 50)")
    parser.add_argument("--reproduce", default=None, metavar="BLOB",
                        help="replay one shrunk failing program (VERSION:BLOB printed by a failing run)")
    parser.add_argument("--report", action="store_true",
                        help="after the run, print the share of programs that reached each event (preemption, "
                             "prefix hit, eviction, rejected draft, late fault, ...)")
    parser.add_argument("--report-json", default=None, metavar="FILE", help="write that report as JSON too")
    parser.set_defaults(func=run)
    return parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``fuzz`` subcommand on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "fuzz", help="fuzz the scheduler and KV cache against their invariants",
        description="Run the scheduler state machine under Hypothesis (docs/DESIGN.md invariants 1-9).")
    return _configure(parser)


def run(args: argparse.Namespace) -> int:
    from tokenbudget.testing.fuzz import load_config_file, run_fuzz

    if args.examples < 1 or args.steps < 1:
        print("tokenbudget fuzz: --examples and --steps must be >= 1", file=sys.stderr)
        return 2
    config = None
    if args.config is not None:
        try:
            config = load_config_file(args.config)
        except (OSError, ValueError) as exc:  # tomllib/json decode errors are ValueErrors
            print(f"tokenbudget fuzz: bad --config: {exc}", file=sys.stderr)
            return 2
    engine_log = logging.getLogger("tokenbudget")
    level = engine_log.level
    engine_log.setLevel(logging.CRITICAL)
    try:
        return run_fuzz(args.examples, seed=args.seed, config=config, steps=args.steps,
                        config_path=args.config, reproduce=args.reproduce,
                        report=args.report or args.report_json is not None, report_json=args.report_json)
    finally:
        engine_log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = _configure(argparse.ArgumentParser(prog="tokenbudget fuzz", description=__doc__.splitlines()[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
