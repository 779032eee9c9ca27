"""What the FP8-weight tests (``fp8_weights=True``: tests/nn/test_fp8_weights_*.py,
tests/optim/test_fp8_weights_optim.py) share: a training loop, the comparison of two
state dicts, and one DDP rank's run."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import fp8train


def train_steps(
    model: nn.Module, optimizer, shape: tuple[int, ...], num_steps: int, first: int = 0, *,
    autocast: bool = False, seed: int | None = None,
) -> list[float]:  # fmt: skip
    """Steps ``first, first + 1, ...``: an input of ``shape`` seeded by the step (in the
    model's first parameter's dtype) learns to reproduce itself, gradients clipped to norm
    1; inside ``fp8train.autocast()`` where ``autocast``. ``seed`` seeds torch's default
    generator first (NVFP4's stochastic rounding draws from it). The losses."""
    if seed is not None:
        torch.manual_seed(seed)
    dtype, losses = next(model.parameters()).dtype, []
    for step in range(first, first + num_steps):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        with fp8train.autocast() if autocast else contextlib.nullcontext():
            loss = (model(x).float() - x.float()).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_equal_states(expected: dict, actual: dict) -> None:
    """The same keys and values, and every value of ``actual`` a plain tensor (a plain
    model loads it)."""
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert type(actual[key]) is torch.Tensor, key
        assert torch.equal(value, actual[key]), key


def ddp_state_after(model: nn.Module, optimizer, x: torch.Tensor, num_steps: int) -> dict:
    """One DDP rank: ``num_steps`` steps of ``model`` (DDP-wrapped) on its slice ``x``; a
    copy of the wrapped module's state dict."""
    for _ in range(num_steps):
        (model(x) - x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {key: value.clone() for key, value in model.module.state_dict().items()}
