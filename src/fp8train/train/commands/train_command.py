"""``fp8train train``: train the default GPT (or ``--data FILE``, or ``--model
module:function``) with any recipe, as ``TrainingArguments`` say."""

from __future__ import annotations

import argparse
import json

from ...parallel.distributed import close_distributed
from ..arguments import TrainingArguments
from ..trainer_setup import describe_bf16_matmuls
from .flags import add_training_flags, main_process_output, resolve_training

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``train`` sub-command of ``commands``."""
    parser = commands.add_parser(
        "train", help="train the default GPT (or --data FILE) with any recipe", allow_abbrev=False
    )
    add_training_flags(parser, {})
    parser.set_defaults(run=run)


def _train(training: TrainingArguments) -> dict:
    """Train on the model of ``training``; the result, with the trainer dropped."""
    from ..trainer import Trainer
    from ..user_model import model_setup

    setup = model_setup(training)
    trainer = Trainer(setup.model_factory, training, setup.train_dataset, setup.eval_dataset, loss_fn=setup.loss_fn)
    return trainer.train()


def run(args: argparse.Namespace) -> int:
    _, say = main_process_output()
    training = resolve_training(args, {})
    say(json.dumps(training.to_dict(), indent=2))
    say(describe_bf16_matmuls(training))
    result = _train(training)
    close_distributed()  # after the trainer (its DDP Reducer) is gone: see close_distributed
    say(
        f"final train loss {result['final_train_loss']:.4f}, val loss {result['final_val_loss']:.4f}, "
        f"{result['tokens_per_second']:.0f} tokens/s; outputs in {training.output_dir}"
    )
    return 0
