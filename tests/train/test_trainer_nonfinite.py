"""``on_nonfinite``: a NaN injected into one layer at one step stops the run with a message
naming the step and the layer (the checkpoint before it loads and resumes), or skips
exactly that step and goes on with clean FP8 state; the command line reports it in one
line with exit code 1."""

import math

import pytest
import torch

import fp8train
import fp8train.train.trainer as trainer_module
from fp8train.train.arguments import TrainingArguments
from fp8train.train.commands.compare import build_model
from fp8train.train.data import embedded_text, split_text
from fp8train.train.trainer import Trainer
from fp8train.train.trainer_setup import lr_factor

from ..helpers.faults import PoisonGradient
from ..helpers.rank_failures import run_ranks
from ._trainer_helpers import DATA_BYTES, TINY, _args, _metrics
from .commands.test_cli import TINY_FLAGS, _run

FAULT_STEP = 3  # 1-based, as in metrics.jsonl and the messages
FAULT_LAYER = "blocks.0.fc"
NUM_POISONED = 5
STEPS = 4


def _nan_into_input(module, args):
    x = args[0].clone()
    x[0, 0, :NUM_POISONED] = float("nan")
    return (x,)


def _nan_into_gradient(module, args):
    return (PoisonGradient.apply(args[0]),)


def _inject(trainer: Trainer, layer: str, *, at_step: int = FAULT_STEP, backward: bool = False, once: bool = False):
    """Make ``layer`` go non-finite in training step ``at_step``: a NaN in its input, or with
    ``backward`` in the gradient of its input, which reaches the layers before it. Every
    call of that step (the re-run too), or with ``once`` only the first."""
    calls = []

    def in_fault_step(module) -> bool:
        if not (module.training and trainer.step == at_step - 1) or (once and calls):
            return False
        calls.append(trainer.step)
        return True

    inject = _nan_into_gradient if backward else _nan_into_input
    module = trainer.model.get_submodule(layer)
    module.register_forward_pre_hook(lambda m, a: inject(m, a) if in_fault_step(m) else None)


def _trainer(args: TrainingArguments, datasets, **kwargs) -> Trainer:
    return Trainer(lambda: build_model(args), args, *datasets, **kwargs)


def _fp8_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: b for name, b in trainer.model.named_buffers() if name.endswith(("fp8_scale", "fp8_amax_history"))}


# ---------------------------------------------------------------------------- stop


def test_stop_names_the_step_and_the_layer_and_the_checkpoint_before_resumes(datasets, tmp_path):
    args = _args(tmp_path, steps=STEPS, fp8_recipe="delayed", checkpoint_interval=2, eval_interval=0)
    trainer = _trainer(args, datasets)
    _inject(trainer, FAULT_LAYER)
    with pytest.raises(fp8train.NonFiniteError) as caught:
        trainer.train()
    message = str(caught.value)
    assert message.startswith(f"step {FAULT_STEP} (fp8_recipe=delayed, mixed_precision=bf16): non-finite loss (nan); ")
    assert (
        f"first non-finite value: input of the output GEMM of {FAULT_LAYER} (Float8Linear, recipe delayed) in the "
        f"forward: {NUM_POISONED} NaN" in message
    )
    assert f"the newest checkpoint, {tmp_path / 'checkpoint-2'}, verifies: resume from it" in message
    assert "\n" not in message
    error = caught.value
    assert error.step == FAULT_STEP
    assert (error.finding.module, error.finding.gemm, error.finding.operand) == (FAULT_LAYER, "output", "input")
    # Nothing of the bad step was saved; the model's FP8 state is as before it.
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
    assert all(torch.isfinite(b).all() for b in _fp8_state(trainer).values())
    # The checkpoint before it loads and the run resumes from it to the end.
    resumed = _trainer(TrainingArguments(**{**args.to_dict(), "resume": True}), datasets).train()
    assert len(resumed["losses"]) == STEPS and all(math.isfinite(loss) for loss in resumed["losses"])
    assert resumed["losses"][:2] == [r["loss"] for r in _metrics(tmp_path)][:2]


def test_a_non_finite_gradient_names_the_layer_whose_grad_output_it_reached(datasets, tmp_path):
    # The forward and the loss are finite; the gradient of fc_proj's input goes NaN and
    # reaches the fc layer's output (through GELU) as its grad_output.
    args = _args(tmp_path, steps=STEPS, fp8_recipe="tensorwise", save_checkpoints=False, eval_interval=0)
    trainer = _trainer(args, datasets)
    _inject(trainer, "blocks.0.fc_proj", backward=True)
    with pytest.raises(fp8train.NonFiniteError) as caught:
        trainer.train()
    message = str(caught.value)
    setting = "(fp8_recipe=tensorwise, mixed_precision=bf16)"
    assert f"step {FAULT_STEP} {setting}: non-finite gradient norm (nan; loss" in message
    finding = caught.value.finding
    assert (finding.module, finding.gemm, finding.operand, finding.phase) == (
        FAULT_LAYER, "grad_input", "grad_output", "backward"
    )
    assert (f"first non-finite value: grad_output of the grad_input GEMM of {FAULT_LAYER} (Float8Linear, recipe "
            "tensorwise) in the backward: ") in message
    assert "no checkpoint was written before it" in message


def test_a_fault_the_rerun_does_not_see_is_not_named(datasets, tmp_path):
    args = _args(tmp_path, steps=STEPS, save_checkpoints=False, eval_interval=0)
    trainer = _trainer(args, datasets)
    _inject(trainer, FAULT_LAYER, once=True)
    with pytest.raises(fp8train.NonFiniteError, match="found no non-finite value, so no place is named") as caught:
        trainer.train()
    assert "fp8_recipe=none" in str(caught.value) and caught.value.finding is None


def test_a_loss_fn_that_makes_the_nan_is_named(datasets, tmp_path):
    args = _args(tmp_path, steps=STEPS, save_checkpoints=False, eval_interval=0)
    holder = {}

    def loss_fn(model, inputs, targets):
        loss = model(inputs, targets)
        return loss * math.nan if holder["trainer"].step == FAULT_STEP - 1 else loss

    trainer = holder["trainer"] = _trainer(args, datasets, loss_fn=loss_fn)
    expected = r"every module's forward was finite, but loss_fn made the loss non-finite \(nan\)"
    with pytest.raises(fp8train.NonFiniteError, match=expected):
        trainer.train()


# ---------------------------------------------------------------------------- skip


def test_skip_skips_exactly_that_step_and_restores_the_fp8_state(datasets, tmp_path, caplog):
    args = _args(tmp_path / "skip", steps=STEPS, fp8_recipe="delayed", on_nonfinite="skip", checkpoint_interval=2,
                 eval_interval=0)
    trainer = _trainer(args, datasets)
    _inject(trainer, FAULT_LAYER)
    result = trainer.train()
    losses = result["losses"]
    assert math.isnan(losses[FAULT_STEP - 1])
    assert all(math.isfinite(loss) for i, loss in enumerate(losses) if i != FAULT_STEP - 1)
    records = _metrics(args.output_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if r.get("skipped")] == [FAULT_STEP]
    fp8_state = _fp8_state(trainer)
    assert fp8_state and all(torch.isfinite(b).all() for b in fp8_state.values())
    assert math.isfinite(result["final_train_loss"])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith(f"step {FAULT_STEP} (fp8_recipe=delayed") and FAULT_LAYER in m and "skipped the step" in m
               for m in warnings), warnings
    # The step counter and the learning-rate schedule went on as in a run without the fault.
    assert [r["lr"] for r in records] == [args.learning_rate * lr_factor(args, step) for step in range(STEPS)]


def test_a_skipped_step_leaves_the_model_and_optimizer_as_the_step_before(datasets, tmp_path):
    # Within warmup the learning rate does not depend on `steps`: a 3-step run whose third
    # step is skipped ends where a 2-step run ends, bit for bit (FP8 state included).
    def run(steps: int, fault: bool) -> Trainer:
        args = _args(tmp_path / f"{steps}", steps=steps, warmup_steps=4, fp8_recipe="delayed", on_nonfinite="skip",
                     save_checkpoints=False, eval_interval=0)
        trainer = _trainer(args, datasets)
        if fault:
            _inject(trainer, FAULT_LAYER)
        trainer.train()
        return trainer

    skipped, reference = run(FAULT_STEP, fault=True), run(FAULT_STEP - 1, fault=False)
    reference_state = reference.model.state_dict()
    for name, value in skipped.model.state_dict().items():
        assert torch.equal(value, reference_state[name]), name
    reference_optimizer = reference.optimizer.state_dict()["state"]
    for index, state in skipped.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, reference_optimizer[index][key]), (index, key)


def test_fp16_leaves_overflowing_gradients_to_the_grad_scaler(datasets, tmp_path):
    args = _args(tmp_path, steps=STEPS, mixed_precision="fp16", save_checkpoints=False, eval_interval=0)
    trainer = _trainer(args, datasets)
    _inject(trainer, "blocks.0.fc_proj", backward=True)  # finite loss, NaN gradients: the scaler skips the step
    result = trainer.train()
    assert all(math.isfinite(loss) for loss in result["losses"])
    assert not any(r.get("skipped") for r in _metrics(tmp_path))
    trainer = _trainer(_args(tmp_path / "loss", steps=STEPS, mixed_precision="fp16", save_checkpoints=False,
                             eval_interval=0), datasets)
    _inject(trainer, FAULT_LAYER)  # a NaN loss: the sentinel's
    with pytest.raises(fp8train.NonFiniteError, match=f"step {FAULT_STEP} .*mixed_precision=fp16.*non-finite loss"):
        trainer.train()


def test_on_nonfinite_is_checked():
    with pytest.raises(ValueError, match="on_nonfinite='ignore'.*stop.*skip"):
        TrainingArguments(on_nonfinite="ignore")
    assert TrainingArguments().on_nonfinite == "stop"


# ---------------------------------------------------------------------------- command line


def test_the_command_line_reports_a_non_finite_step_in_one_line(capsys, tmp_path, monkeypatch):
    train = trainer_module.Trainer.train

    def train_with_a_fault(self):
        _inject(self, FAULT_LAYER, at_step=2)
        return train(self)

    monkeypatch.setattr(trainer_module.Trainer, "train", train_with_a_fault)
    code, _, err = _run(["train", "--output_dir", str(tmp_path), "--steps", "3", "--fp8_recipe", "rowwise",
                         "--eval_interval", "0", *TINY_FLAGS], capsys)
    assert code == 1
    assert "Traceback" not in err and "internal error" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("fp8train train: error: step 2 (fp8_recipe=rowwise, mixed_precision=bf16): non-finite loss")
    assert f"input of the output GEMM of {FAULT_LAYER} (Float8Linear, recipe rowwise)" in line


# ---------------------------------------------------------------------------- distributed


def _ddp_worker(rank: int, results, output_dir: str) -> None:
    """A tiny DDP run whose fc layer gets a NaN input on rank 1 only, in FAULT_STEP."""
    args = TrainingArguments(**TINY, steps=STEPS - 1, strategy="ddp", fp8_recipe="delayed", on_nonfinite="skip",
                             save_checkpoints=False, eval_interval=0, output_dir=output_dir)
    datasets = split_text(embedded_text()[:DATA_BYTES], args.seq_len)
    trainer = _trainer(args, datasets)
    if rank == 1:
        _inject(trainer, FAULT_LAYER)
    result = trainer.train()
    fp8_finite = all(bool(torch.isfinite(b).all()) for b in _fp8_state(trainer).values())
    results[rank] = {"losses": result["losses"], "fp8_finite": fp8_finite}


@pytest.mark.heavy
def test_every_ddp_rank_skips_the_step_that_went_non_finite_on_one(tmp_path, capfd):
    # Both ranks take the same decision, re-run the step together (their collectives
    # match, or the run would hang) and go on; rank 0 names rank 1's layer.
    run = run_ranks(_ddp_worker, str(tmp_path), timeout=120.0)
    assert run.exitcodes == [0, 0]
    losses = run.results[0]["losses"]
    assert str(losses) == str(run.results[1]["losses"])  # the mean over ranks, on both (NaN != NaN)
    assert math.isnan(losses[FAULT_STEP - 1]) and sum(map(math.isnan, losses)) == 1
    assert run.results[0]["fp8_finite"] and run.results[1]["fp8_finite"]
    assert [r["step"] for r in _metrics(tmp_path) if r.get("skipped")] == [FAULT_STEP]
    warning = f"on rank 1 of 2, first non-finite value: input of the output GEMM of {FAULT_LAYER} (Float8Linear"
    assert capfd.readouterr().err.count(warning) == 1  # from rank 0 alone
