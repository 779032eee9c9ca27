"""Every recipe's Float8Linear on the device (backend ``auto``: hardware GEMMs where the
device runs the recipe) against the same module emulated on the CPU, from the same weights,
inputs and output gradient.

Quantization on CUDA is byte-identical to the CPU's (checked first, per granularity), so
both sides quantize to the same codes and only the GEMMs differ: by the hardware's error
(:data:`~tests.helpers.tolerances.HARDWARE_GEMM_REL_ERR` of the largest result) and one rounding
to the output dtype on each side. NVFP4's backward rounds stochastically from each device's
own generator: there the two sides' gradients are held to the same accuracy against a
float64 reference instead.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import fp8train
from fp8train.nn.config import Float8ModuleConfig
from fp8train.quant import gemm as gemm_module
from fp8train.spec.recipes import RECIPE_NAMES
from tests.conftest import signal_to_quantization_noise_db
from tests.helpers.tolerances import HARDWARE_GEMM_REL_ERR, min_sqnr_db

from ._suite import assert_close, draws_random_numbers, gemm_families, runs_on_hardware

IN_FEATURES, OUT_FEATURES = 384, 256  # K/128 = 3 and 2: blockwise's unpadded-K hazard
LEADING = (3, 100)  # 300 tokens: padded to every recipe's block
FP8_MIN_SQNR_DB = 20.0  # a gradient of FP8 operands against float64 (tensorwise here: 24.7 dB)
SQNR_SPREAD_DB = 3.0
"""How far the device's and the CPU's accuracy (SQNR, dB) may differ where their stochastic
rounding draws differ: about 0.1 dB of sampling noise at these sizes; a lost scale or a
biased draw costs far more."""


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and output gradient whose magnitude varies by column (so row, block and
    tensor scales differ), made on the CPU."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*LEADING, IN_FEATURES, generator=generator) * torch.exp(torch.randn(IN_FEATURES, generator=generator))
    grad = torch.randn(*LEADING, OUT_FEATURES, generator=generator)
    return x.to(dtype), grad.to(dtype)


def _twins(recipe: str, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """``(cpu, on_device)``: one Linear's weights as an emulated CPU Float8Linear and an
    ``auto`` one on ``device``."""
    torch.manual_seed(0)
    linear = nn.Linear(IN_FEATURES, OUT_FEATURES, dtype=dtype)
    cpu = fp8train.Float8Linear.from_linear(linear, config=Float8ModuleConfig(recipe=recipe, backend="emulated"))
    on_device = fp8train.Float8Linear.from_linear(copy.deepcopy(linear).to(device), recipe)
    return cpu, on_device


def _step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward and backward on ``module``'s device: output and the three gradients, on the CPU."""
    device = module.weight.device
    x = x.to(device, copy=True).requires_grad_()  # a copy: x itself is the other side's too
    out = module(x)
    out.backward(grad.to(device))
    tensors = {"output": out, "grad_input": x.grad, "grad_weight": module.weight.grad, "grad_bias": module.bias.grad}
    return {name: tensor.detach().cpu() for name, tensor in tensors.items()}


def _high_precision_gradients(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The exact grad_input and grad_weight of the module's Linear, in float64."""
    weight, x64, grad64 = module.weight.detach().double(), x.double().flatten(0, -2), grad.double().flatten(0, -2)
    return {"grad_input": (grad64 @ weight).reshape(x.shape), "grad_weight": grad64.T @ x64}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_float8_linear_matches_the_cpu_emulation(recipe, dtype, device):
    x, grad = _inputs(dtype)
    cpu, on_device = _twins(recipe, dtype, device)
    expected, actual = _step(cpu, x, grad), _step(on_device, x, grad)
    random_backward = draws_random_numbers(recipe)
    for name in expected:
        if random_backward and name in ("grad_input", "grad_weight"):
            continue
        # Each side rounds its result to the dtype once (twice where a bias is added after).
        assert_close(actual[name], expected[name], rel_err=HARDWARE_GEMM_REL_ERR, roundings=2, what=f"{recipe} {name}")
    if random_backward:
        reference = _high_precision_gradients(cpu, x, grad)
        floor = min_sqnr_db(recipe, FP8_MIN_SQNR_DB)
        for name, exact in reference.items():
            sqnr_cpu = signal_to_quantization_noise_db(exact, expected[name])
            sqnr_device = signal_to_quantization_noise_db(exact, actual[name])
            assert sqnr_device >= floor, f"{recipe} {name}: {sqnr_device:.1f} dB on {device}, floor {floor}"
            assert abs(sqnr_device - sqnr_cpu) <= SQNR_SPREAD_DB, (name, sqnr_device, sqnr_cpu)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_backend_log_says_where_each_gemm_family_runs(recipe, device, caplog):
    """``auto`` says once per family which backend runs it: hardware where the device has
    it, else the emulation with the reason (MXFP8, NVFP4, MXFP4 on Hopper)."""
    gemm_module.backend_log.forget()  # said once per process: say it again for this test
    caplog.set_level(logging.INFO, logger="fp8train")
    x, grad = _inputs(torch.bfloat16)
    _step(_twins(recipe, torch.bfloat16, device)[1], x, grad)
    said = [record.getMessage() for record in caplog.records if record.name.startswith("fp8train")]
    for family in gemm_families(recipe):
        lines = [line for line in said if family.label in line and device.type in line]
        assert lines, f"nothing logged about {family.label} GEMMs on {device.type}: {said}"
        if runs_on_hardware(family, device):
            assert any("hardware" in line for line in lines), lines
        else:
            # The reason names what is missing: the device type or its compute capability.
            assert any("emulated" in line and ("SM " in line or "on cpu" in line) for line in lines), lines


_GRANULARITIES = [
    ("tensor", {}), ("row", {}), ("block1x128", {}), ("block128x128", {}), ("mx", {}),
    ("nvfp4", {}), ("nvfp4", {"rht": True}), ("nvfp4_2d", {}), ("mxfp4", {}),
]


def _bytes(qt) -> list[torch.Tensor]:
    """Data, scales and global amax as bytes on the CPU. One-byte dtypes are viewed as bytes
    before any copy: PyTorch has no copy kernel for float4_e2m1fn_x2."""
    parts = [qt.data, qt.scale_inv] + ([] if qt.global_amax is None else [qt.global_amax])
    return [
        part.detach().view(torch.uint8).contiguous().reshape(-1).cpu() if part.element_size() == 1
        else part.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        for part in parts
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize(
    "granularity, options", _GRANULARITIES, ids=[g + ("-rht" if o else "") for g, o in _GRANULARITIES]
)
def test_quantize_is_byte_identical_to_the_cpu(granularity, options, axis, dtype, device):
    """Zeros, tiny and huge values: the same codes, scales and global amax on both."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, generator=generator) * torch.exp(3 * torch.randn(1, 512, generator=generator))
    x[:, :32] = 0.0
    x[:16, 32:64] *= 1e-30
    x[16:32, 64:96] *= 1e30
    x = x.to(dtype)
    expected = fp8train.quant.quantize(x, granularity, axis=axis, **options)
    actual = fp8train.quant.quantize(x.to(device), granularity, axis=axis, **options)
    assert actual.data.device.type == device.type
    for name, a, e in zip(("data", "scale_inv", "global_amax"), _bytes(actual), _bytes(expected)):
        mismatches = int((a != e).sum())
        assert mismatches == 0, f"{granularity} {name}: {mismatches} of {e.numel()} bytes differ from the CPU's"
