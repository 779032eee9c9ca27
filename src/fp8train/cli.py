"""The ``fp8train`` command line."""

from __future__ import annotations

import argparse
import sys

from .selfcheck import format_table, run_selfcheck

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8train", description="FP8 training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    selfcheck = commands.add_parser(
        "selfcheck",
        help="quantize a random tensor with every recipe and print the error of each operand",
    )
    selfcheck.add_argument("--rows", type=int, default=512, help="rows of the random tensor (multiple of 128)")
    selfcheck.add_argument("--cols", type=int, default=1024, help="columns of the random tensor (multiple of 128)")
    selfcheck.add_argument("--seed", type=int, default=0, help="random seed")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fp8train`` and ``python -m fp8train``; returns the exit code."""
    args = _build_parser().parse_args(argv)
    if args.command == "selfcheck":
        for name, value in (("--rows", args.rows), ("--cols", args.cols)):
            if value <= 0 or value % 128:
                print(f"fp8train selfcheck: error: {name} {value} must be a positive multiple of 128", file=sys.stderr)
                return 2
        print(format_table(run_selfcheck(args.rows, args.cols, args.seed)))
    return 0
