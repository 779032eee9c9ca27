"""A small MLP trained with every recipe converges like its bf16 twin."""

import pytest
import torch
from torch import nn

import fp8train
from fp8train.recipes import RECIPE_NAMES

STEPS = 300
# The task is fitted to ~4% of its initial loss, where FP8's quantization noise (about
# 30 dB SQNR per operand) is visible: measured gaps are 6-11% of the bf16 final loss,
# i.e. under 0.5% of the initial loss. An FP8 run's final loss may exceed the bf16 run's
# by at most this fraction of the initial loss.
MAX_LOSS_GAP_OF_INITIAL = 0.01
# And training must actually have happened: final loss well under the initial one.
MIN_LOSS_REDUCTION = 5.0


def _teacher_data(generator: torch.Generator):
    teacher = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 128))
    x = torch.randn(2048, 128, generator=generator)
    with torch.no_grad():
        y = teacher(x)
    return x, y


def _train(recipe: str | None) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, y = _teacher_data(generator)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 128))
    model = model.to(torch.bfloat16)
    if recipe is not None:
        fp8train.convert_to_float8_training(model, recipe, backend="emulated")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    order = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        index = torch.randint(0, x.shape[0], (128,), generator=order)
        loss = nn.functional.mse_loss(model(x[index].bfloat16()).float(), y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x.bfloat16()).float(), y).item()
    return losses[0], final


@pytest.fixture(scope="module")
def bf16_run():
    return _train(None)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_fp8_recipe_converges_like_bf16(recipe, bf16_run):
    bf16_initial, bf16_final = bf16_run
    initial, final = _train(recipe)
    assert torch.isfinite(torch.tensor(final))
    assert final < initial / MIN_LOSS_REDUCTION
    assert final - bf16_final <= MAX_LOSS_GAP_OF_INITIAL * bf16_initial, (final, bf16_final)
