"""``Trainer`` checkpoints: delayed scaling's FP8 state, bit-exact resume, a crash while
saving leaves the previous checkpoint whole, and how the latest checkpoint is found."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

import fp8train.train.checkpoint
from fp8train.nn.convert import FP8_STATE_NAMES
from fp8train.train.commands.compare import build_model
from fp8train.train.trainer import Trainer, latest_checkpoint

from ._trainer_helpers import (
    CHECKPOINT_FILES,
    NUM_LINEAR_LAYERS,
    _args,
    _metrics,
    _train,
    _trainer_state,
)

# ---------------------------------------------------------------------------- checkpoints


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


# nvfp4: its stochastic rounding draws from torch's generator, whose state the checkpoint keeps
# (as do bf16 masters, rounded stochastically); "low-precision optimizer": bf16 masters with an
# FP8 first moment and a bf16 second one (fp8train.optim.AdamW's state in optimizer.pt).
LOW_PRECISION_OPTIMIZER = {"optimizer_master_dtype": "bf16", "optimizer_state_dtype": "fp8"}


@pytest.mark.parametrize(
    ("recipe", "optimizer"),
    [
        (None, {}), ("delayed", {}), ("mxfp8", {}), ("nvfp4", {}), ("mxfp8", LOW_PRECISION_OPTIMIZER),
        ("delayed", {"fp8_weights": True}),
        # Mixtures (issue 41): a delayed direction's state, and a recipe per module.
        ("hybrid(forward=delayed,backward=mxfp8)", {}),
        ("*.attn.*=mxfp8;*=nvfp4", {}),
    ],
    ids=[
        "bf16", "delayed", "mxfp8", "nvfp4", "mxfp8-low-precision-optimizer", "delayed-fp8-weights",
        "hybrid-delayed-forward", "recipe-map",
    ],
)
def test_resume_continues_bit_identically(recipe, optimizer, datasets, tmp_path, monkeypatch):
    settings = dict(steps=8, checkpoint_interval=4, eval_interval=4, fp8_recipe=recipe, **optimizer)
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
        monkeypatch.setattr(
            fp8train.train.checkpoint, "save_file", _failing_on_step_8(fp8train.train.checkpoint.save_file)
        )
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
        ("checkpoint-11", False),  # no manifest.json: interrupted, or written before checksums
        (".checkpoint-12.tmp-123", True),  # a leftover staging directory
        ("checkpoint-13.bak", True),
    ]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "manifest.json").write_text("{}")
    (tmp_path / "checkpoint-14").write_text("a file, not a checkpoint")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
