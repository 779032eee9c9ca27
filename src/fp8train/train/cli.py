"""The ``fp8train`` command line: ``train``, ``compare`` and ``selfcheck``.

Settings come from ``TrainingArguments`` defaults, then ``--config FILE`` (TOML or YAML,
flat ``key = value``), then ``--key value`` flags. Bad input is a one-line error and exit
code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tomllib
import traceback
from pathlib import Path

from ..nn.nonfinite import NonFiniteError
from ..parallel.distributed import RankFailedError, close_distributed
from ..spec.checks import ArgumentTypeError, UnsupportedHardwareError
from ..spec.recipes import RECIPE_NAMES
from .arguments import TrainingArguments
from .data import read_text_file
from .selfcheck import format_table, run_selfcheck

__all__ = ["main"]

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class UsageError(Exception):
    """Bad command-line input: reported in one line with exit code 2."""


def _parse_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def _converter(annotation: str):
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


def _add_training_flags(parser: argparse.ArgumentParser, defaults: dict) -> None:
    parser.add_argument("--config", type=Path, help="TOML or YAML file of settings (flat key = value)")
    for f in dataclasses.fields(TrainingArguments):
        default = defaults.get(f.name, f.default)
        parser.add_argument(
            f"--{f.name}",
            type=_converter(f.type),
            default=argparse.SUPPRESS,
            metavar=f.type.replace(" | None", "").upper(),
            help=f"{f.metadata['help']} (default: {default})",
        )


def _read_config(path: Path) -> dict:
    text = read_text_file(path, "config file", "pass a .toml or .yaml file of settings")
    try:
        if path.suffix == ".toml":
            values = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            raise UsageError(f"config file {str(path)!r} must end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, ImportError) as error:
        raise UsageError(f"config file {str(path)!r}: {error}") from None
    except Exception as error:  # yaml.YAMLError without importing yaml up front
        if type(error).__module__.startswith("yaml"):
            raise UsageError(f"config file {str(path)!r}: {error}".splitlines()[0]) from None
        raise
    if not isinstance(values, dict):
        raise UsageError(f"config file {str(path)!r} must hold key = value settings")
    fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    for key, value in values.items():
        if key not in fields:
            raise UsageError(f"config file {str(path)!r}: unknown key {key!r}")
        if isinstance(value, str) and fields[key].type not in ("str", "str | None"):
            # YAML 1.1 reads 3e-4 (no dot) as a string: convert as the command line does.
            try:
                values[key] = _converter(fields[key].type)(value)
            except argparse.ArgumentTypeError as error:
                raise UsageError(f"config file {str(path)!r}: {key}: {error}") from None
    return values


def _resolve(namespace: argparse.Namespace, defaults: dict, extra: tuple[str, ...] = ()) -> TrainingArguments:
    values = dict(defaults)
    flags = {k: v for k, v in vars(namespace).items() if k not in ("command", "config") + extra}
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


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8train", description="FP8 training for PyTorch.", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train", help="train the default GPT (or --data FILE) with any recipe", allow_abbrev=False
    )
    _add_training_flags(train, {})

    compare = commands.add_parser(
        "compare", help="train once per recipe from the same start and report each against bf16", allow_abbrev=False
    )
    from .compare import DEFAULT_RECIPES

    compare.add_argument(
        "--recipes",
        default=",".join(DEFAULT_RECIPES),
        help=f"comma-separated recipes, bf16 included (default: {','.join(DEFAULT_RECIPES)})",
    )
    compare.add_argument(
        "--seeds",
        type=_converter("int"),
        default=1,
        metavar="N",
        help="train every recipe under seeds seed, ..., seed + N - 1 and report mean, spread and the bf16 noise "
        "floor (default: 1)",
    )
    _add_training_flags(compare, _COMPARE_DEFAULTS)

    inspect = commands.add_parser(
        "inspect",
        help="one high-precision step of the model; what every recipe's quantization does to each GEMM",
        allow_abbrev=False,
    )
    inspect.add_argument(
        "--recipes",
        default=",".join(RECIPE_NAMES),
        help=f"comma-separated FP8 recipes to measure (default: {','.join(RECIPE_NAMES)})",
    )
    inspect.add_argument(
        "--checkpoint", type=Path, default=None, help="a run's checkpoint-<step> directory whose weights to load first"
    )
    _add_training_flags(inspect, _INSPECT_DEFAULTS)

    export = commands.add_parser(
        "export",
        aliases=["export-fp8"],
        help="write a run's transformers model as a quantized checkpoint for transformers and vLLM "
        "(--format; default: block-scaled E4M3)",
        allow_abbrev=False,
    )
    export.add_argument("checkpoint", type=Path, help="a checkpoint-<step> directory, or a run's output_dir (its newest)")
    export.add_argument("output", type=Path, help="the FP8 checkpoint directory to write (absent or empty)")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    export.add_argument(
        "--format", default="fp8_block",
        help="the checkpoint format, one of fp8train.save_pretrained_quantized's (docs/serving.md): fp8_block "
        "(default: E4M3 blocks, float32 scales), fp8_block_ue8m0 (power-of-two scales, scale_fmt ue8m0), "
        "compressed-tensors' nvfp4 (weight-only NVFP4), mxfp4 or mxfp8 (as llm-compressor writes them for vLLM), "
        "or nvfp4_modelopt (weight-only NVFP4 as NVIDIA ModelOpt writes it, vLLM's modelopt_fp4)",
    )
    export.add_argument(
        "--calibration-batches", type=int, default=0, metavar="N",
        help="nvfp4 and nvfp4_modelopt: write W4A4, each Linear's activation scale from the largest |input| it "
        "sees on N of the run's validation batches (default 0: weight-only)",
    )

    selfcheck = commands.add_parser(
        "selfcheck", help="quantize a random tensor with every recipe and print the error of each operand"
    )
    selfcheck.add_argument("--rows", type=int, default=512, help="rows of the random tensor (multiple of 128)")
    selfcheck.add_argument("--cols", type=int, default=1024, help="columns of the random tensor (multiple of 128)")
    selfcheck.add_argument("--seed", type=int, default=0, help="random seed")
    return parser


_COMPARE_DEFAULTS = {"output_dir": "runs/compare", "save_checkpoints": False}
_INSPECT_DEFAULTS = {"output_dir": "runs/inspect"}


def _train(training: TrainingArguments) -> dict:
    """Train on the model of ``training``; the result, with the trainer dropped."""
    from .trainer import Trainer
    from .user_model import model_setup

    setup = model_setup(training)
    trainer = Trainer(setup.model_factory, training, setup.train_dataset, setup.eval_dataset, loss_fn=setup.loss_fn)
    return trainer.train()


def _run(args: argparse.Namespace) -> int:
    if args.command == "selfcheck":
        for name, value in (("--rows", args.rows), ("--cols", args.cols)):
            if value <= 0 or value % 128:
                raise UsageError(f"{name} {value} must be a positive multiple of 128")
        print(format_table(run_selfcheck(args.rows, args.cols, args.seed)))
        return 0

    # Under torchrun only rank 0 speaks (warnings and errors still come from every rank).
    main_process = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if main_process else logging.WARNING, format="%(message)s", stream=sys.stderr)
    say = print if main_process else (lambda *args, **kwargs: None)
    if args.command == "train":
        training = _resolve(args, {})
        say(json.dumps(training.to_dict(), indent=2))
        result = _train(training)
        close_distributed()  # after the trainer (its DDP Reducer) is gone: see close_distributed
        say(
            f"final train loss {result['final_train_loss']:.4f}, val loss {result['final_val_loss']:.4f}, "
            f"{result['tokens_per_second']:.0f} tokens/s; outputs in {training.output_dir}"
        )
        return 0

    if args.command in ("export", "export-fp8"):
        from .export_command import run_export_fp8

        written = run_export_fp8(
            args.checkpoint, args.output, overwrite=args.overwrite, format=args.format,
            calibration_batches=args.calibration_batches,
        )
        print(written.summary())
        return 0

    if args.command == "inspect":
        from .inspect_command import run_inspect
        from .inspect_report import summary_text

        names = [name.strip() for name in args.recipes.split(",") if name.strip()]
        training = _resolve(args, _INSPECT_DEFAULTS, extra=("recipes", "checkpoint"))
        inspection = run_inspect(training, names, args.checkpoint)
        print(summary_text(inspection))
        print(f"wrote {training.output_dir}/report.md, records.json and heatmap.png")
        return 0

    from .compare import parse_recipes, run_compare

    recipes = parse_recipes(args.recipes)
    if args.seeds < 1:
        raise UsageError(f"--seeds {args.seeds} must be an int >= 1 (the number of seeds per recipe)")
    training = _resolve(args, _COMPARE_DEFAULTS, extra=("recipes", "seeds"))
    print(json.dumps({"recipes": recipes, "seeds": args.seeds, **training.to_dict()}, indent=2))
    results = run_compare(recipes, training, num_seeds=args.seeds)
    close_distributed()
    if main_process:  # the one rank that wrote the report
        print((Path(training.output_dir) / "report.md").read_text())
        print(f"wrote {training.output_dir}/report.md, loss_curves.png and results.json")
    return 0 if results else 1


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
    parser = _build_parser()
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
