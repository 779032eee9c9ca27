"""FP8 weights follow delayed scaling's weight scale between optimizer steps: gradient
accumulation and a module run twice in a forward compute what the high-precision weight
computes, bit for bit, and a plain loop re-quantizes each weight once a step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.weights.float8_weight import Float8Weight
from fp8train.optim import AdamW
from tests.nn.weights.test_fp8_weights_experts import _Moe
from tests.nn.weights.test_fp8_weights_modules import _Attention

WIDTH = 32


class _Twice(nn.Module):
    """One Linear run twice in a forward (outside fp8train.autocast each run updates its scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.nn.functional.gelu(self.inner(x)))


def _conv1d_block() -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return nn.Sequential(Conv1D(4 * WIDTH, WIDTH), nn.GELU(), Conv1D(WIDTH, 4 * WIDTH))


BUILDERS = {
    "linear": lambda: nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)),
    "twice": _Twice,
    "conv1d": _conv1d_block,
    "experts": lambda: _Moe(WIDTH),
    "attention": lambda: _Attention(WIDTH),  # self- then cross-attention: run twice a forward
}


def _run(build, fp8_weights: bool, accumulate: int, autocast: bool) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = fp8train.convert_to_float8_training(build(), recipe="delayed", backend="emulated", fp8_weights=fp8_weights)
    optimizer = AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        for micro in range(accumulate):
            shape = (2, 8, WIDTH) if isinstance(model, _Attention) else (16, WIDTH)  # batch_first attention
            x = torch.randn(shape, generator=torch.Generator().manual_seed(10 * step + micro))
            with fp8train.autocast() if autocast else torch.enable_grad():
                loss = (model(x) - x).square().mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, model.state_dict()


@pytest.mark.parametrize("autocast", [False, True], ids=["any_loop", "fp8_autocast"])
@pytest.mark.parametrize("module", sorted(BUILDERS))
def test_gradient_accumulation_under_delayed_scaling_is_bit_identical(module, autocast):
    expected_losses, expected_state = _run(BUILDERS[module], False, accumulate=3, autocast=autocast)
    losses, state = _run(BUILDERS[module], True, accumulate=3, autocast=autocast)
    assert losses == expected_losses
    for key, value in expected_state.items():
        assert torch.equal(value, state[key]), key


def test_a_plain_loop_requantizes_each_weight_once_a_step(monkeypatch):
    """The optimizer's re-quantization uses the scale the next forward uses, so a plain
    loop's forward finds nothing to follow; with accumulation a later micro-batch
    re-quantizes where the weight scale moved (after the first, which records the new
    weight's amax), at most once each."""
    calls = []
    requantize = Float8Weight.requantize_
    monkeypatch.setattr(Float8Weight, "requantize_", lambda self, *a: calls.append(1) or requantize(self, *a))
    _run(BUILDERS["linear"], True, accumulate=1, autocast=False)
    assert len(calls) == 3 * 2  # 3 steps, 2 weights
    calls.clear()
    _run(BUILDERS["linear"], True, accumulate=3, autocast=False)
    assert 3 * 2 < len(calls) <= 3 * 2 + 3 * 2 * 2


@pytest.mark.parametrize("module", ["linear", "conv1d", "experts"])
def test_module_to_moves_a_model_with_fp8_weights_and_it_trains_the_same(module):
    """``module.to()`` swaps each parameter for its moved copy (``torch.utils.swap_tensors``,
    which refuses a tensor with a weak reference to it): before and after the optimizer
    takes the masters; the run equals the one that was never moved."""
    expected, _ = _run(BUILDERS[module], True, accumulate=1, autocast=False)
    torch.manual_seed(0)
    model = fp8train.convert_to_float8_training(BUILDERS[module](), recipe="delayed", backend="emulated", fp8_weights=True)
    model.to("cpu").float()
    optimizer = AdamW(model.parameters(), lr=1e-2)
    model.to(torch.float32)
    losses = []
    for step in range(3):
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(10 * step))
        loss = (model(x) - x).square().mean()
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    assert losses == expected
