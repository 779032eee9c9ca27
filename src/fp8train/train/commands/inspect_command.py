"""``fp8train inspect``: the command line's glue around :func:`fp8train.inspect`. It builds
the model as the trainer would, loads a checkpoint's weights if given, measures the
trainer's first batch and writes the report."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...nn.convert import drop_fp8_state
from ..arguments import TrainingArguments
from ..checkpoint import CheckpointError, verify_checkpoint
from ...diagnostics.inspect_report import write_report
from ...diagnostics.inspection import Inspection
from ...diagnostics.inspector import inspect_step
from ..trainer_setup import (
    convert_for_training, local_rank_from_env, mixed_precision_autocast, sample_batch, training_device,
)
from ..user_model import model_setup
from ...spec.recipes import RECIPE_NAMES
from .compare import split_recipe_list
from .flags import add_training_flags, main_process_output, resolve_training

__all__ = ["run_inspect", "add_parser", "run"]


def run_inspect(args: TrainingArguments, recipes: list[str], checkpoint: str | Path | None = None) -> Inspection:
    """``fp8train inspect``: build the model of ``args`` (the default GPT, or
    ``args.model``) as the trainer would (seeded; converted with ``args.fp8_recipe`` if
    set, ``args.high_precision_modules`` left in high precision), load ``checkpoint``'s
    weights if given, and inspect it on the trainer's first batch under the trainer's
    autocast; the report goes to ``args.output_dir``."""
    setup = model_setup(args)
    torch.manual_seed(args.seed)
    model = setup.model_factory()
    device = training_device(args, local_rank_from_env())
    model = model.to(device)
    if args.fp8_recipe is not None:
        model = convert_for_training(model, args)
    if checkpoint is not None:
        from safetensors.torch import load_file

        problems = verify_checkpoint(checkpoint)
        if problems:
            raise CheckpointError(f"checkpoint {checkpoint} does not verify: {problems[0]}")
        state = load_file(str(Path(checkpoint) / "model.safetensors"), device=str(device))
        model.load_state_dict(state if args.fp8_recipe is not None else drop_fp8_state(state))
    inputs, targets = sample_batch(setup.train_dataset, args.seed, 0, args.batch_size)
    inputs, targets = inputs.to(device), targets.to(device)
    with mixed_precision_autocast(args, device):
        inspection = inspect_step(
            model, lambda: setup.loss_fn(model, inputs, targets), recipes=recipes, dim_alignment=args.fp8_dim_alignment
        )
    write_report(inspection, args.output_dir)
    return inspection


DEFAULTS = {"output_dir": "runs/inspect"}
"""``inspect``'s own defaults, over ``TrainingArguments``'."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``inspect`` sub-command of ``commands``."""
    parser = commands.add_parser(
        "inspect",
        help="one high-precision step of the model; what every recipe's quantization does to each GEMM",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--recipes",
        default=",".join(RECIPE_NAMES),
        help=(
            f"comma-separated FP8 recipes to measure (default: {','.join(RECIPE_NAMES)}); a mixture "
            "'hybrid(forward=nvfp4,backward=mxfp8)' or a recipe per module '*.attn.*=mxfp8;*.fc*=nvfp4' is one"
        ),
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="a run's checkpoint-<step> directory whose weights to load first"
    )
    add_training_flags(parser, DEFAULTS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ...diagnostics.inspect_report import summary_text

    main_process_output()
    names = [name for name in split_recipe_list(args.recipes) if name]
    training = resolve_training(args, DEFAULTS, extra=("recipes", "checkpoint"))
    inspection = run_inspect(training, names, args.checkpoint)
    print(summary_text(inspection))
    print(f"wrote {training.output_dir}/report.md, records.json and heatmap.png")
    return 0
