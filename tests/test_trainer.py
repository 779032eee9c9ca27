"""``Trainer``: tiny runs of the default GPT and of a user's own model; metrics, the
learning-rate schedule, checkpoints that are atomic and resume bit-exactly."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import fp8train.trainer
from fp8train.arguments import TrainingArguments
from fp8train.compare import build_model
from fp8train.convert import FP8_STATE_NAMES
from fp8train.data import embedded_text, load_text, split_text
from fp8train.recipes import RECIPE_NAMES
from fp8train.trainer import Trainer, latest_checkpoint

# Tiny settings: every run here takes well under a second or two on a slow CPU.
TINY = dict(
    n_layer=1, n_embd=128, n_head=2, seq_len=32, batch_size=4, eval_batches=1,
    learning_rate=3e-3, warmup_steps=2, device="cpu", log_interval=4,
)
NUM_LINEAR_LAYERS = 5  # n_layer=1: qkv, proj, fc, fc_proj, and lm_head
DATA_BYTES = 12_000
# Over 12 steps at lr 3e-3 the byte-level loss falls from ~5.6 (ln 256 = 5.5) to ~3.4;
# the mean of the last 4 steps is ~1.5 nats under the mean of the first 4 for every recipe.
TRAIN_STEPS = 12
MIN_LOSS_DROP = 0.5
CHECKPOINT_FILES = {
    "model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "scaler.pt", "config.json", "trainer_state.json",
}
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_second", "elapsed_seconds"}
RESULT_KEYS = {
    "losses", "val_losses", "final_train_loss", "final_val_loss", "tokens_per_second",
    "converted_layers", "total_linear_layers",
}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(embedded_text()[:DATA_BYTES], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def datasets(data_file):
    return split_text(load_text(data_file), TINY["seq_len"])


def _args(output_dir: Path, **overrides) -> TrainingArguments:
    return TrainingArguments(output_dir=str(output_dir), **{**TINY, **overrides})


def _train(args: TrainingArguments, datasets, **kwargs) -> dict:
    train, val = datasets
    return Trainer(lambda: build_model(args), args, train, val, **kwargs).train()


def _metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def _trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def _mean(values) -> float:
    return sum(values) / len(values)


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
    assert result["converted_layers"] == (0 if recipe is None else NUM_LINEAR_LAYERS)


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
        rng = torch.load(checkpoint / "rng.pt", weights_only=False)
        assert {"torch", "python"} <= set(rng)
    assert latest_checkpoint(output_dir) == output_dir / "checkpoint-8"


def test_checkpoint_weights_load_into_a_fresh_model(bf16_run):
    args, trainer, _ = bf16_run
    weights = load_file(str(Path(args.output_dir) / "checkpoint-8" / "model.safetensors"))
    fresh = build_model(args)
    assert set(weights) == set(fresh.state_dict())
    fresh.load_state_dict(weights, strict=True)
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_delayed_checkpoint_holds_fp8_state(datasets, tmp_path):
    args = _args(tmp_path, steps=2, fp8_recipe="delayed")
    train, val = datasets
    trainer = Trainer(lambda: build_model(args), args, train, val)
    trainer.train()
    weights = load_file(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    plain_keys = set(build_model(args).state_dict())
    fp8_keys = set(weights) - plain_keys
    assert plain_keys <= set(weights)
    assert {key.rpartition(".")[2] for key in fp8_keys} == set(FP8_STATE_NAMES)
    assert len(fp8_keys) == len(FP8_STATE_NAMES) * NUM_LINEAR_LAYERS
    model_state = trainer.model.state_dict()
    for key in fp8_keys:
        assert torch.equal(weights[key], model_state[key]), key
    # Two steps of delayed scaling have moved the scales away from their initial 1.
    assert any(not torch.all(weights[key] == 1) for key in fp8_keys if key.endswith("fp8_scale"))


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("recipe", [None, "delayed", "mxfp8"])
def test_resume_continues_bit_identically(recipe, datasets, tmp_path, monkeypatch):
    settings = dict(steps=8, checkpoint_interval=4, eval_interval=4, fp8_recipe=recipe)
    straight = _args(tmp_path / "straight", **settings)
    straight_result = _train(straight, datasets)

    # Same settings (so the same schedule), killed right after the checkpoint of step 4.
    interrupted = _args(tmp_path / "interrupted", **settings)
    save_checkpoint = Trainer.save_checkpoint

    def save_then_die(self, history):
        path = save_checkpoint(self, history)
        if self.step == 4:
            raise _Interrupted
        return path

    monkeypatch.setattr(Trainer, "save_checkpoint", save_then_die)
    with pytest.raises(_Interrupted):
        _train(interrupted, datasets)
    monkeypatch.undo()
    assert latest_checkpoint(interrupted.output_dir).name == "checkpoint-4"

    resumed_result = _train(dataclasses.replace(interrupted, resume=True), datasets)
    assert resumed_result["losses"] == straight_result["losses"]
    assert resumed_result["val_losses"] == straight_result["val_losses"]
    assert [r["loss"] for r in _metrics(interrupted.output_dir)] == straight_result["losses"]
    assert _trainer_state(tmp_path / "interrupted" / "checkpoint-8")["losses"] == straight_result["losses"]
    final_straight = load_file(str(tmp_path / "straight" / "checkpoint-8" / "model.safetensors"))
    final_resumed = load_file(str(tmp_path / "interrupted" / "checkpoint-8" / "model.safetensors"))
    assert final_straight.keys() == final_resumed.keys()
    for key in final_straight:
        assert torch.equal(final_straight[key], final_resumed[key]), key


def _failing_on_step_8(write):
    def failing(obj, path, *args, **kwargs):
        if ".checkpoint-8." in str(path):
            raise OSError("No space left on device")
        return write(obj, path, *args, **kwargs)

    return failing


@pytest.mark.parametrize("writer", ["save_file", "torch.save"])
def test_crash_while_saving_leaves_the_previous_checkpoint_whole(writer, datasets, tmp_path, monkeypatch):
    args = _args(tmp_path, steps=8, checkpoint_interval=4)
    if writer == "save_file":
        monkeypatch.setattr(fp8train.trainer, "save_file", _failing_on_step_8(fp8train.trainer.save_file))
    else:
        monkeypatch.setattr(torch, "save", _failing_on_step_8(torch.save))
    with pytest.raises(OSError, match="No space left"):
        _train(args, datasets)
    monkeypatch.undo()

    previous = tmp_path / "checkpoint-4"
    assert {p.name for p in previous.iterdir()} == CHECKPOINT_FILES
    assert not (tmp_path / "checkpoint-8").exists()
    assert all(p.name.startswith(".checkpoint-8.tmp-") for p in tmp_path.glob(".checkpoint-*"))
    assert latest_checkpoint(tmp_path) == previous
    losses_before_crash = _trainer_state(previous)["losses"]

    result = _train(dataclasses.replace(args, resume=True), datasets)
    assert result["losses"][:4] == losses_before_crash
    assert len(result["losses"]) == args.steps
    assert _trainer_state(latest_checkpoint(tmp_path))["step"] == args.steps


def test_resume_without_checkpoint_starts_from_scratch(datasets, tmp_path):
    fresh = _train(_args(tmp_path / "fresh", steps=2, save_checkpoints=False), datasets)
    resumed = _train(_args(tmp_path / "resumed", steps=2, save_checkpoints=False, resume=True), datasets)
    assert resumed["losses"] == fresh["losses"]


def test_latest_checkpoint_takes_the_highest_complete_step(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for name, complete in [
        ("checkpoint-9", True),
        ("checkpoint-10", True),  # numeric, not lexicographic, order
        ("checkpoint-11", False),  # no trainer_state.json: interrupted
        (".checkpoint-12.tmp-123", True),  # a leftover staging directory
        ("checkpoint-13.bak", True),
    ]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-14").write_text("a file, not a checkpoint")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


# ---------------------------------------------------------------------------- user models

NUM_CLASSES = 16
NUM_EXAMPLES = 512
# A linearly separable 16-class task: over 12 steps at lr 1e-2 the mean cross-entropy of
# the last 4 steps is ~0.75 under that of the first 4 (~2.7, near ln 16).
MIN_CLASSIFIER_LOSS_DROP = 0.3


def _classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, NUM_CLASSES))


def _classification_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(NUM_EXAMPLES, 128, generator=generator)
    teacher = torch.randn(128, NUM_CLASSES, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def _cross_entropy(model, inputs, targets):
    return F.cross_entropy(model(inputs), targets)


def test_user_model_with_its_own_loss_trains_in_fp8(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path), steps=TRAIN_STEPS, batch_size=64, learning_rate=1e-2, warmup_steps=2,
        fp8_recipe="rowwise", device="cpu", save_checkpoints=False,
    )
    trainer = Trainer(_classifier(), args, _classification_data(), loss_fn=_cross_entropy)
    result = trainer.train()
    assert (result["converted_layers"], result["total_linear_layers"]) == (2, 2)
    losses = result["losses"]
    assert all(math.isfinite(loss) for loss in losses)
    assert _mean(losses[-4:]) < _mean(losses[:4]) - MIN_CLASSIFIER_LOSS_DROP, losses
    assert result["val_losses"] == {} and math.isnan(result["final_val_loss"])


def test_model_factory_is_built_after_seeding(tmp_path):
    calls = []

    def factory():
        calls.append(1)
        return _classifier()

    dataset = _classification_data()

    def initial_weights(seed: int) -> dict:
        torch.manual_seed(1234 + len(calls))  # global RNG state before the Trainer must not matter
        args = TrainingArguments(output_dir=str(tmp_path), seed=seed, fp8_recipe="rowwise", device="cpu")
        return Trainer(factory, args, dataset, loss_fn=_cross_entropy).model.state_dict()

    first, again, other_seed = initial_weights(0), initial_weights(0), initial_weights(1)
    assert len(calls) == 3
    assert first.keys() == again.keys() == other_seed.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["0.weight"], other_seed["0.weight"])


def test_empty_train_dataset_is_an_error(tmp_path):
    empty = TensorDataset(torch.empty(0, 128), torch.empty(0, dtype=torch.long))
    with pytest.raises(ValueError, match="train_dataset is empty"):
        Trainer(_classifier(), TrainingArguments(output_dir=str(tmp_path), device="cpu"), empty, loss_fn=_cross_entropy)


def test_model_with_no_convertible_linear_is_an_error(tmp_path):
    model = nn.Sequential(nn.Linear(100, 100), nn.GELU(), nn.Linear(100, NUM_CLASSES))
    args = TrainingArguments(output_dir=str(tmp_path), fp8_recipe="blockwise", device="cpu")
    with pytest.raises(ValueError, match="converted none of the model's 2 Linear layers"):
        Trainer(model, args, _classification_data(), loss_fn=_cross_entropy)
