"""What every training command's settings are made of: ``TrainingArguments`` defaults, then
the command's own defaults, then ``--config FILE`` (TOML or YAML, flat ``key = value``),
then ``--key value`` flags; and the one way a command reports bad input (``UsageError``:
one line, exit code 2)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tomllib
from pathlib import Path
from typing import Callable

from ..arguments import TrainingArguments
from ..data import read_text_file

__all__ = ["UsageError", "converter", "add_training_flags", "resolve_training", "main_process_output"]

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class UsageError(Exception):
    """Bad command-line input: reported in one line with exit code 2."""


def _parse_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def converter(annotation: str) -> Callable[[str], object]:
    """The parser of a flag whose ``TrainingArguments`` annotation is ``annotation``
    (``"int"``, ``"float | None"``, ...): ``none``/``null``/empty is ``None`` where allowed."""
    optional = "None" in annotation
    base = annotation.replace("| None", "").strip()
    convert = {"int": int, "float": float, "bool": _parse_bool, "str": str}[base]

    def parse(text: str):
        if optional and text.lower() in ("none", "null", ""):
            return None
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {base}") from None

    parse.__name__ = base  # argparse names the type in its messages
    return parse


def add_training_flags(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """``--config`` and one ``--<field>`` per ``TrainingArguments`` field, each helped with its
    default (the command's own ``defaults`` where it has one)."""
    parser.add_argument("--config", type=Path, help="TOML or YAML file of settings (flat key = value)")
    for f in dataclasses.fields(TrainingArguments):
        default = defaults.get(f.name, f.default)
        parser.add_argument(
            f"--{f.name}",
            type=converter(f.type),
            default=argparse.SUPPRESS,
            metavar=f.type.replace(" | None", "").upper(),
            help=f"{f.metadata['help']} (default: {default})",
        )


def _parse_config_text(path: Path, text: str) -> object:
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text) or {}
        raise UsageError(f"config file {str(path)!r} must end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, ImportError) as error:
        raise UsageError(f"config file {str(path)!r}: {error}") from None
    except Exception as error:  # yaml.YAMLError without importing yaml up front
        if type(error).__module__.startswith("yaml"):
            raise UsageError(f"config file {str(path)!r}: {error}".splitlines()[0]) from None
        raise


def _read_config(path: Path) -> dict:
    text = read_text_file(path, "config file", "pass a .toml or .yaml file of settings")
    values = _parse_config_text(path, text)
    if not isinstance(values, dict):
        raise UsageError(f"config file {str(path)!r} must hold key = value settings")
    fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    for key, value in values.items():
        if key not in fields:
            raise UsageError(f"config file {str(path)!r}: unknown key {key!r}")
        if isinstance(value, str) and fields[key].type not in ("str", "str | None"):
            # YAML 1.1 reads 3e-4 (no dot) as a string: convert as the command line does.
            try:
                values[key] = converter(fields[key].type)(value)
            except argparse.ArgumentTypeError as error:
                raise UsageError(f"config file {str(path)!r}: {key}: {error}") from None
    return values


def resolve_training(namespace: argparse.Namespace, defaults: dict, extra: tuple[str, ...] = ()) -> TrainingArguments:
    """The ``TrainingArguments`` of a parsed command line: ``defaults``, then its ``--config``
    file, then its flags (all but ``extra``, the command's own)."""
    values = dict(defaults)
    own = ("command", "config", "run") + extra
    flags = {k: v for k, v in vars(namespace).items() if k not in own}
    if getattr(namespace, "config", None) is not None:
        values.update(_read_config(namespace.config))
    values.update(flags)
    try:
        training = TrainingArguments(**values)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    output_dir = Path(training.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output_dir {training.output_dir!r} is a file; pass a directory (it is created if missing)")
    return training


def main_process_output() -> tuple[bool, Callable[..., None]]:
    """Log to stderr, and say whether this is the process that speaks (under torchrun only
    rank 0: warnings and errors still come from every rank), with its ``print``."""
    main_process = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if main_process else logging.WARNING, format="%(message)s", stream=sys.stderr)
    return main_process, (print if main_process else (lambda *args, **kwargs: None))
