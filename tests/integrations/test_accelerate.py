"""fp8train with accelerate, in one process: convert, make the optimizer, then
``Accelerator.prepare``; the loop is accelerate's and FP8 runs in it, bit-identical to a
plain loop, with bf16 autocast, and resuming exactly from ``save_state``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8train

from .test_transformers import NUM_LINEARS, assert_state_dicts_equal, count_fp8_forwards, tiny_llama

accelerate = pytest.importorskip("accelerate")

NUM_STEPS = 3
TOKENS = torch.randint(0, 256, (2 * NUM_STEPS, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state; each test starts its own (as accelerate's tests do)."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train(recipe, *, accelerator=None, save_at: int | None = None, checkpoint: Path | None = None,
          resume: Path | None = None):  # fmt: skip
    """A converted tiny Llama trained ``NUM_STEPS`` steps (of 2 rows); with an Accelerator,
    prepared by it, saving its state after step ``save_at`` or resuming from ``resume``:
    the model, the losses of the steps it ran, the number of FP8 forwards."""
    model = fp8train.convert_to_float8_training(tiny_llama(), recipe)  # 1. convert
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # 2. the optimizer
    batches = torch.utils.data.DataLoader(TOKENS, batch_size=2)
    if accelerator is not None:
        model, optimizer, batches = accelerator.prepare(model, optimizer, batches)  # 3. prepare
        if resume is not None:
            accelerator.load_state(str(resume))
            batches = accelerator.skip_first_batches(batches, save_at)
    forwards, losses = count_fp8_forwards(model), []
    for step, batch in enumerate(batches, start=save_at if resume is not None else 0):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss) if accelerator is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if resume is None and step + 1 == save_at:
            accelerator.save_state(str(checkpoint))
    return model, losses, forwards[0]


def test_accelerate_runs_fp8_bit_identically_to_a_plain_loop():
    model, losses, forwards = train("tensorwise", accelerator=accelerate.Accelerator(cpu=True))
    plain_model, plain_losses, _ = train("tensorwise")
    assert forwards == NUM_STEPS * NUM_LINEARS
    assert losses == plain_losses
    assert_state_dicts_equal(plain_model, model)


def test_accelerate_runs_fp8_under_bf16_mixed_precision():
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    _, losses, forwards = train("mxfp8", accelerator=accelerator)
    _, plain_losses, _ = train("mxfp8")
    assert forwards == NUM_STEPS * NUM_LINEARS
    assert losses != plain_losses
    assert losses == pytest.approx(plain_losses, rel=0.01)


def check_resume_is_bit_identical(recipe, tmp_path: Path) -> None:
    checkpoint = tmp_path / "state"
    model, losses, _ = train(recipe, accelerator=accelerate.Accelerator(cpu=True), save_at=2, checkpoint=checkpoint)
    accelerate.state.AcceleratorState._reset_state(True)
    resumed, resumed_losses, _ = train(recipe, accelerator=accelerate.Accelerator(cpu=True), save_at=2,
                                       resume=checkpoint)  # fmt: skip
    assert resumed_losses == losses[2:]
    assert_state_dicts_equal(model, resumed)


def test_accelerate_resume_from_save_state_is_bit_identical(tmp_path):
    check_resume_is_bit_identical("tensorwise", tmp_path)


def test_accelerate_resume_from_save_state_is_bit_identical_with_delayed_scaling(tmp_path):
    check_resume_is_bit_identical(fp8train.DelayedScaling(amax_history_len=16), tmp_path)
