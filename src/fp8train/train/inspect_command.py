"""``fp8train inspect``: the command line's glue around :func:`fp8train.inspect`. It builds
the model as the trainer would, loads a checkpoint's weights if given, measures the
trainer's first batch and writes the report."""

from __future__ import annotations

from pathlib import Path

import torch

from ..nn.convert import drop_fp8_state
from .arguments import TrainingArguments
from .checkpoint import CheckpointError, verify_checkpoint
from .inspect_report import write_report
from .inspection import Inspection
from .inspector import inspect_step
from .trainer_setup import (
    convert_for_training, local_rank_from_env, mixed_precision_autocast, sample_batch, training_device,
)
from .user_model import model_setup

__all__ = ["run_inspect"]


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
