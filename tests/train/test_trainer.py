"""``Trainer``: tiny runs of the default GPT with every recipe; metrics, the
learning-rate schedule, evaluation, gradient accumulation, mixed precision, and the
checkpoints a run writes. Resuming and crashes are in test_trainer_checkpoints.py, user
models in test_trainer_user_models.py."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8train.spec.recipes import RECIPE_NAMES
from tests.helpers.tolerances import is_fp4
from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.compare import build_model
from fp8train.train.rng import load_rng_state
from fp8train.train.trainer import Trainer, latest_checkpoint

from ._trainer_helpers import (
    CHECKPOINT_FILES,
    METRIC_KEYS,
    MIN_LOSS_DROP,
    NUM_LINEAR_LAYERS,
    RESULT_KEYS,
    TRAIN_STEPS,
    _args,
    _mean,
    _metrics,
    _train,
    _trainer_state,
)


# ---------------------------------------------------------------------------- training


@pytest.mark.parametrize("recipe", (None,) + RECIPE_NAMES)
def test_every_recipe_trains_the_default_gpt(recipe, datasets, tmp_path):
    args = _args(tmp_path, steps=TRAIN_STEPS, fp8_recipe=recipe, save_checkpoints=False, eval_interval=0)
    result = _train(args, datasets)
    assert RESULT_KEYS <= set(result)
    losses = result["losses"]
    assert len(losses) == TRAIN_STEPS and all(math.isfinite(loss) for loss in losses)
    assert _mean(losses[-4:]) < _mean(losses[:4]) - MIN_LOSS_DROP, losses
    assert list(result["val_losses"]) == [TRAIN_STEPS]
    assert result["final_val_loss"] == result["val_losses"][TRAIN_STEPS]
    assert math.isfinite(result["final_val_loss"])
    assert result["final_train_loss"] == pytest.approx(_mean(losses[-args.log_interval:]))
    assert result["tokens_per_second"] > 0
    assert result["total_linear_layers"] == NUM_LINEAR_LAYERS
    # A 4-bit recipe keeps the head in high precision by default (high_precision_modules="auto").
    expected_converted = 0 if recipe is None else NUM_LINEAR_LAYERS - (1 if is_fp4(recipe) else 0)
    assert result["converted_layers"] == expected_converted


@pytest.fixture(scope="module")
def bf16_run(datasets, tmp_path_factory):
    """8 steps, checkpoints at 4 and 8, evaluation at 4 and 8."""
    args = _args(tmp_path_factory.mktemp("bf16_run"), steps=8, warmup_steps=3, checkpoint_interval=4, eval_interval=4)
    trainer = Trainer(lambda: build_model(args), args, *datasets)
    return args, trainer, trainer.train()


def test_metrics_jsonl_has_one_record_per_step(bf16_run):
    args, _, result = bf16_run
    records = _metrics(args.output_dir)
    assert [record["step"] for record in records] == list(range(1, args.steps + 1))
    for record in records:
        evaluated = record["step"] % args.eval_interval == 0
        assert set(record) == METRIC_KEYS | ({"val_loss"} if evaluated else set()), record
        assert all(math.isfinite(value) for value in record.values()), record
        assert record["grad_norm"] > 0 and record["tokens_per_second"] > 0
    assert [record["loss"] for record in records] == result["losses"]
    assert {r["step"]: r["val_loss"] for r in records if "val_loss" in r} == result["val_losses"]
    elapsed = [record["elapsed_seconds"] for record in records]
    assert elapsed == sorted(elapsed)


def test_config_json_is_the_resolved_arguments(bf16_run):
    args, _, _ = bf16_run
    assert json.loads((Path(args.output_dir) / "config.json").read_text()) == args.to_dict()


def _scheduled_lr(args: TrainingArguments, step_index: int) -> float:
    """The documented schedule by hand: the lr of the 0-based ``step_index``-th update."""
    if step_index < args.warmup_steps:
        return args.learning_rate * (step_index + 1) / args.warmup_steps
    progress = min(1.0, (step_index - args.warmup_steps) / (args.steps - args.warmup_steps))
    low = args.learning_rate * args.min_lr_ratio
    return low + (args.learning_rate - low) * 0.5 * (1 + math.cos(math.pi * progress))


def test_learning_rate_warms_up_then_decays_to_min_lr_ratio(bf16_run):
    args, trainer, _ = bf16_run
    lrs = [record["lr"] for record in _metrics(args.output_dir)]
    # The record of step s holds the lr step s used.
    assert lrs == pytest.approx([_scheduled_lr(args, index) for index in range(args.steps)])
    assert max(lrs) == pytest.approx(args.learning_rate)
    decay = lrs[args.warmup_steps - 1:]
    assert decay == sorted(decay, reverse=True)
    assert decay[-1] > args.learning_rate * args.min_lr_ratio  # the floor comes after the last step


def test_first_update_uses_the_first_warmup_lr(datasets, tmp_path):
    args = _args(tmp_path, steps=4, warmup_steps=4, save_checkpoints=False)
    trainer = Trainer(lambda: build_model(args), args, *datasets)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(_scheduled_lr(args, 0))


# Evaluation must not change training: the same run with and without intermediate
# evaluations must give the same training losses.
@pytest.mark.parametrize(
    "recipe",
    [
        None,
        "tensorwise",
        "delayed",
    ],
)
def test_evaluation_does_not_change_training(recipe, datasets, tmp_path):
    runs = [
        _train(_args(tmp_path / str(interval), steps=6, fp8_recipe=recipe, eval_interval=interval,
                     save_checkpoints=False), datasets)
        for interval in (0, 2)
    ]
    assert list(runs[1]["val_losses"]) == [2, 4, 6]
    assert runs[0]["losses"] == runs[1]["losses"]


def test_grad_accumulation_logs_the_mean_of_its_micro_batch_losses(datasets, tmp_path):
    micro_losses = []

    def recording_loss(model, inputs, targets):
        loss = model(inputs, targets)
        if model.training:
            micro_losses.append(loss.item())
        return loss

    args = _args(tmp_path, steps=2, grad_accumulation_steps=2, fp8_recipe="tensorwise")
    result = _train(args, datasets, loss_fn=recording_loss)
    assert len(micro_losses) == args.steps * args.grad_accumulation_steps
    assert micro_losses[0] != micro_losses[1]  # two different micro-batches
    assert result["losses"] == pytest.approx([_mean(micro_losses[0:2]), _mean(micro_losses[2:4])], rel=1e-6)
    state = _trainer_state(latest_checkpoint(tmp_path))
    assert state["data_position"] == args.steps * args.grad_accumulation_steps


@pytest.mark.parametrize(
    "mixed_precision, recipe", [("fp16", None), ("fp16", "tensorwise"), ("no", None), ("no", "rowwise")]
)
def test_mixed_precision_modes_train(mixed_precision, recipe, datasets, tmp_path):
    args = _args(tmp_path, steps=3, mixed_precision=mixed_precision, fp8_recipe=recipe)
    result = _train(args, datasets)
    assert all(math.isfinite(loss) for loss in result["losses"])
    scaler_state = torch.load(tmp_path / "checkpoint-3" / "scaler.pt", weights_only=True)
    # fp16 trains with a grad scaler, whose scale is checkpointed; the others have none.
    assert ("scale" in scaler_state) == (mixed_precision == "fp16")


# ---------------------------------------------------------------------------- checkpoints


def test_checkpoints_at_interval_and_end_hold_every_file(bf16_run):
    args, trainer, result = bf16_run
    output_dir = Path(args.output_dir)
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert not list(output_dir.glob(".checkpoint-*"))  # staging directories were renamed
    for step in (4, 8):
        checkpoint = output_dir / f"checkpoint-{step}"
        assert {p.name for p in checkpoint.iterdir()} == CHECKPOINT_FILES
        assert json.loads((checkpoint / "config.json").read_text()) == args.to_dict()
        state = _trainer_state(checkpoint)
        assert state["step"] == step and state["data_position"] == step
        assert state["losses"] == result["losses"][:step]
        assert state["val_losses"] == {str(k): v for k, v in result["val_losses"].items() if k <= step}
        assert torch.load(checkpoint / "scheduler.pt", weights_only=True)["last_epoch"] == step
        optimizer_state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        assert len(optimizer_state["state"]) == sum(1 for _ in trainer.model.parameters())
        rng = load_rng_state(checkpoint / "rng.safetensors")
        assert rng.torch_cpu.dtype == torch.uint8 and len(rng.python[1]) == 625
    assert latest_checkpoint(output_dir) == output_dir / "checkpoint-8"


def test_checkpoint_weights_load_into_a_fresh_model(bf16_run):
    args, trainer, _ = bf16_run
    weights = load_file(str(Path(args.output_dir) / "checkpoint-8" / "model.safetensors"))
    fresh = build_model(args)
    assert set(weights) == set(fresh.state_dict())
    fresh.load_state_dict(weights, strict=True)
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
