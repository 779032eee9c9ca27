"""Delayed scaling over ten training steps of a small model on the device, beside the same
model emulated on the CPU: every loss finite (on an H200 it was NaN at step 2: values above
last step's scale turned to NaN in the cast), the scales updating, and both runs alike.

At step :data:`SPIKE_STEP` the input grows :data:`SPIKE` times, far beyond what last step's
scale maps into E4M3's range: it must saturate. The first layer's input scale depends only
on the data, so it is equal on both sides; the rest drift apart by the hardware GEMM's
error, through the weights and gradients the steps compute.
"""

from __future__ import annotations

import torch
from torch import nn

import fp8train

STEPS = 10
SPIKE_STEP, SPIKE = 5, 8.0
LEARNING_RATE = 0.05
FIRST_STEP_LOSS_RTOL = 1e-3
"""Step 1 quantizes the same operands on both sides (scale 1, the initial state): the loss
differs by the GEMMs' error alone (1e-3 of max |result| each, far less on average)."""
TRAJECTORY_RTOL = 2e-3
"""Later losses: each step's GEMM error moves the weights and gradients a little. Measured
on the CPU by adding noise of 1e-3 of max |result| (5x the hardware's error) to every GEMM
output: 5e-5."""
SCALE_RTOL = 2.0**-5
"""Scales: a bfloat16 amax that moves by one ulp (2^-7 relative) moves its scale by as
much; the perturbed CPU run above moved one grad_output scale by 1.1%. Four ulps."""


def _model(device: torch.device, backend: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(device, torch.bfloat16)
    return fp8train.convert_to_float8_training(model, "delayed", backend=backend)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(256, 256, generator=generator)
    batches = []
    for step in range(1, STEPS + 1):
        x = torch.randn(256, 256, generator=generator) * (SPIKE if step == SPIKE_STEP else 1.0)
        batches.append((x.bfloat16(), target))
    return batches


def train(model: nn.Module) -> tuple[list[float], list[torch.Tensor]]:
    """SGD steps under ``fp8train.autocast``: each step's loss, and the scales after the last."""
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for x, target in _batches():
        with fp8train.autocast():
            out = model(x.to(device))
        loss = nn.functional.mse_loss(out.float(), target.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [layer.fp8_scale.detach().cpu().clone() for layer in model if hasattr(layer, "fp8_scale")]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_delayed_scaling_trains_ten_steps_like_the_cpu_emulation(device):
    # The same weights (one seed), moved then converted, as the trainer does.
    cpu_model, device_model = _model(torch.device("cpu"), "emulated"), _model(device, "auto")
    cpu_losses, cpu_scales = train(cpu_model)
    device_losses, device_scales = train(device_model)
    assert all(torch.isfinite(torch.tensor(device_losses))), f"non-finite loss on {device}: {device_losses}"
    assert all(torch.isfinite(torch.tensor(cpu_losses))), f"non-finite loss on cpu: {cpu_losses}"
    assert _relative(device_losses[0], cpu_losses[0]) <= FIRST_STEP_LOSS_RTOL, (device_losses[0], cpu_losses[0])
    for step, (on_device, on_cpu) in enumerate(zip(device_losses, cpu_losses), start=1):
        assert _relative(on_device, on_cpu) <= TRAJECTORY_RTOL, f"step {step}: {on_device} on {device}, {on_cpu} on cpu"
    for index, (on_device, on_cpu) in enumerate(zip(device_scales, cpu_scales)):
        assert torch.isfinite(on_device).all() and (on_device > 0).all(), (index, on_device)
        assert not torch.equal(on_device, torch.ones_like(on_device)), f"layer {index}: scales never updated"
        assert torch.allclose(on_device, on_cpu, rtol=SCALE_RTOL, atol=0), (index, on_device, on_cpu)
    # The first layer's input is the data: its amax history, and so its scale, is the CPU's.
    assert device_scales[0][0] == cpu_scales[0][0], (device_scales[0], cpu_scales[0])
