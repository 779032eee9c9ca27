"""The ``fp8train`` command line: ``train``, ``compare``, ``inspect``, ``export`` and
``selfcheck``, one module each (:data:`COMMANDS`), each owning its sub-parser (``add_parser``)
and what it runs (``run``).

Settings come from ``TrainingArguments`` defaults, then ``--config FILE`` (TOML or YAML,
flat ``key = value``), then ``--key value`` flags (:mod:`.flags`). Bad input is a one-line
error and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from ...diagnostics.nonfinite import NonFiniteError
from ...parallel.distributed import RankFailedError
from ...spec.checks import ArgumentTypeError, UnsupportedHardwareError
from . import compare, export_command, inspect_command, selfcheck, train_command
from .flags import UsageError

__all__ = ["main", "build_parser", "COMMANDS"]

COMMANDS = (train_command, compare, inspect_command, export_command, selfcheck)
"""The command modules, in the order ``fp8train --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The ``fp8train`` parser: one sub-parser per command, each of which sets ``run``."""
    parser = argparse.ArgumentParser(prog="fp8train", description="FP8 training for PyTorch.", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def _run(args: argparse.Namespace) -> int:
    return args.run(args)


REPORT_URL = "https://github.com/fp8train/fp8train/issues"

# Raised for a user's input or environment: one line, exit code 2. Everything else is a bug.
EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE, as a shell reports a process SIGPIPE ended

_USER_ERRORS = (UsageError, ValueError, ArgumentTypeError, UnsupportedHardwareError, FileNotFoundError,
                PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.strerror or type(error).__name__}: {error.filename!s}"
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fp8train`` and ``python -m fp8train``; returns the exit code.

    A mistake in the input (a bad value, a missing or unreadable path, a file that is not
    text, a checkpoint that does not fit) is one line on stderr and exit code 2; another
    rank's failure in a distributed run, or a training step that went non-finite
    (``NonFiniteError``), is one line naming it, exit code 1; an interrupt
    exits 130; anything else is a bug: its traceback and a line asking to report it, exit
    code 1.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except _USER_ERRORS as error:
        print(f"fp8train {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return 2
    except (RankFailedError, NonFiniteError) as error:
        # Another rank failed: its own output (and torchrun's report) has the cause. A
        # non-finite step: the message names the step, the place and the checkpoint.
        print(f"fp8train {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fp8train {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`fp8train selfcheck | head`): nothing is wrong
        # here. Point stdout at /dev/null so the interpreter's last flush stays quiet, and
        # exit as a process ended by SIGPIPE does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception:
        traceback.print_exc()
        print(
            f"fp8train {args.command}: internal error: this is a bug in fp8train; please report it at "
            f"{REPORT_URL} with the command line and the traceback above",
            file=sys.stderr,
        )
        return 1
