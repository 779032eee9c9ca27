"""A small MLP trained with every recipe converges like its bf16 twin.

The runs train bf16 parameters, so their bf16 matmuls take the library's route
(tests/helpers/bf16_loops.py): torch's own bf16 GEMMs where the CPU has native bf16, float32
GEMMs of the bf16 operands rounded once where it has not (bf16's numerics, without the
fallback that made the bf16 run 12x slower there)."""

import pytest
import torch
from torch import nn

from fp8train.spec.recipes import RECIPE_NAMES
from tests.helpers.bf16_loops import bf16_matmuls
from tests.helpers.tolerances import is_fp4

STEPS = 300
# The task is fitted to ~4% of its initial loss, where FP8's quantization noise (about
# 30 dB SQNR per operand) is visible: measured gaps are 6-11% of the bf16 final loss,
# i.e. under 0.5% of the initial loss. An FP8 run's final loss may exceed the bf16 run's
# by at most this fraction of the initial loss.
MAX_LOSS_GAP_OF_INITIAL = 0.01
# 4-bit recipes (E2M1 operands, about 15 dB per operand): measured gaps 4.1% (nvfp4) and
# 5.2% (mxfp4) of the initial loss, the final loss about twice bf16's.
FP4_MAX_LOSS_GAP_OF_INITIAL = 0.08
# And training must actually have happened: final loss well under the initial one.
MIN_LOSS_REDUCTION = 5.0


def _teacher_data(generator: torch.Generator, small_model):
    teacher = small_model((128, 256), "tanh", (256, 128), seed=None)
    x = torch.randn(2048, 128, generator=generator)
    with torch.no_grad():
        y = teacher(x)
    return x, y


def _train(recipe: str | None, small_model) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, y = _teacher_data(generator, small_model)
    model = small_model(
        (128, 256), "gelu", (256, 256), "gelu", (256, 128), seed=None, dtype=torch.bfloat16, recipe=recipe
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    order = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        index = torch.randint(0, x.shape[0], (128,), generator=order)
        with bf16_matmuls():  # the forward, as the trainer's autocast: the backward follows it
            out = model(x[index].bfloat16())
        loss = nn.functional.mse_loss(out.float(), y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad(), bf16_matmuls():
        final = nn.functional.mse_loss(model(x.bfloat16()).float(), y).item()
    return losses[0], final


@pytest.fixture(scope="module")
def bf16_run(small_model):
    return _train(None, small_model)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_fp8_recipe_converges_like_bf16(recipe, bf16_run, small_model):
    bf16_initial, bf16_final = bf16_run
    initial, final = _train(recipe, small_model)
    assert torch.isfinite(torch.tensor(final))
    assert final < initial / MIN_LOSS_REDUCTION
    max_gap = FP4_MAX_LOSS_GAP_OF_INITIAL if is_fp4(recipe) else MAX_LOSS_GAP_OF_INITIAL
    assert final - bf16_final <= max_gap * bf16_initial, (final, bf16_final)
