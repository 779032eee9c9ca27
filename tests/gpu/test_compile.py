"""``torch.compile`` of converted models on the device: it compiles, and the compiled
model's outputs and gradients are finite and match eager's
(:data:`~tests.helpers.tolerances.COMPILED_MIN_SQNR_DB`). torch 2.14 with Triton 3.8 gave compiled
float8 training intermittent NaN; on torch 2.11 Dynamo failed on fp8train's autocast state.
Then the trainer's own ``--torch_compile`` path, as a user runs it.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import fp8train
from fp8train.train.commands.cli import main
from tests.conftest import signal_to_quantization_noise_db
from tests.helpers.tolerances import COMPILED_MIN_SQNR_DB

from ._suite import is_finite_number

# One layer per recipe, in one model compiled once (one compile instead of three). Each
# layer's in_features is its output GEMM's K; 384 (blockwise) is K/128 = 3.
LAYERS = (("tensorwise", 256, 512), ("rowwise", 512, 384), ("blockwise", 384, 256))
STEPS = 2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for recipe, in_features, out_features in LAYERS:
        linear = nn.Linear(in_features, out_features).to(device, torch.bfloat16)
        layers += [fp8train.Float8Linear.from_linear(linear, recipe), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fp8train.autocast():
        out = model(x)
    out.float().square().mean().backward()
    return out.detach()


def test_compiled_converted_model_matches_eager(device, sizes):
    eager = _model(device)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend=sizes.compile_backend)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(4, 96, LAYERS[0][1], generator=generator).to(device, torch.bfloat16)
        out_eager, out_compiled = _step(eager, x), _step(compiled, x)
        checks = [("output", out_eager, out_compiled)]
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled_model.parameters()):
            recipe = LAYERS[int(name.split(".")[0]) // 2][0]
            checks.append((f"{recipe} layer {name} grad", p_eager.grad, p_compiled.grad))
        for what, expected, actual in checks:
            assert torch.isfinite(actual).all(), f"step {step}: compiled {what} has NaN or inf"
            sqnr = signal_to_quantization_noise_db(expected, actual)
            assert sqnr >= COMPILED_MIN_SQNR_DB, f"step {step}: compiled {what}: {sqnr:.1f} dB from eager"
        for parameters in (eager.parameters(), compiled_model.parameters()):
            for parameter in parameters:
                parameter.grad = None


def test_trainer_trains_compiled(device, sizes, tmp_path):
    """``fp8train train --torch_compile true``: the trainer's own compile call (on torch 2.11
    it passed an argument that release does not have)."""
    argv = ["train", "--fp8_recipe", "tensorwise", "--torch_compile", "true", "--device", device.type,
            "--output_dir", str(tmp_path), "--save_checkpoints", "false", *sizes.train_flags]
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in records if "loss" in record]
    assert losses and all(is_finite_number(loss) for loss in losses), losses
