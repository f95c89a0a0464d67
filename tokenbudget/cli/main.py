"""The ``tokenbudget`` console script: ``generate``, ``fuzz``, ``serve``, ``bench serve``."""

from __future__ import annotations

import argparse
import logging
import sys

_DESCRIPTION = ("An LLM inference engine with lossless speculative decoding: generate, serve (OpenAI-compatible), "
                "bench serve, fuzz, train-draft.")


def main(argv: list[str] | None = None) -> int:
    from tokenbudget.api.version import package_version
    parser = argparse.ArgumentParser(prog="tokenbudget", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tokenbudget {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    from tokenbudget.cli import generate
    generate.add_parser(sub)
    from tokenbudget.cli import fuzz
    fuzz.add_parser(sub).set_defaults(run=fuzz.run)
    from tokenbudget.cli import serve
    serve.add_parser(sub)
    from tokenbudget.cli import bench_serve
    bench_serve.add_parser(sub)
    from tokenbudget.cli import train_draft
    train_draft.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return int(args.run(args) or 0)
    except (ValueError, OSError) as exc:  # a bad flag, input or model file: one line, no traceback
        print(f"tokenbudget: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
