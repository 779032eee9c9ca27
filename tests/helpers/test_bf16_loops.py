"""tests/helpers/bf16_loops.py follows the library's decision both ways, whatever this
machine is: routed where the CPU has no native bf16, torch's own bf16 GEMMs (the same bits
as without the helper) where it has."""

import contextlib

import pytest
import torch
from torch import nn

import fp8train.quant.gemm.bf16 as bf16_gemm
from fp8train.quant.gemm.bf16 import matmul_via_float32_active

from .bf16_loops import bf16_autocast, bf16_matmuls


@pytest.mark.parametrize(("native", "routed"), [(False, True), (True, False)])
def test_the_route_is_active_only_where_the_cpu_has_no_native_bf16(monkeypatch, native, routed):
    monkeypatch.setattr(bf16_gemm, "NATIVE_BF16_GEMM", native)
    with bf16_matmuls():
        assert matmul_via_float32_active() is routed
    with bf16_autocast():
        assert matmul_via_float32_active() is routed
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not matmul_via_float32_active() and not torch.is_autocast_enabled("cpu")


def _step(layer: nn.Linear, x: torch.Tensor, context) -> tuple[torch.Tensor, ...]:
    layer.zero_grad(set_to_none=True)
    with context():
        out = layer(x)
    out.float().square().sum().backward()
    return out, layer.weight.grad, layer.bias.grad


def _torchs_own(context):
    """The context the helper stands for, without fp8train: nothing, or torch's bf16 autocast."""
    if context is bf16_matmuls:
        return contextlib.nullcontext
    return lambda: torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("context", [bf16_matmuls, bf16_autocast])
def test_a_native_cpu_keeps_torchs_own_gemms_and_the_route_rounds_float32_gemms_once(monkeypatch, context):
    generator = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if context is bf16_matmuls else torch.float32  # bf16 parameters, or autocast's
    layer = nn.Linear(64, 32, dtype=dtype)
    x = torch.randn(48, 64, generator=generator, dtype=dtype)
    monkeypatch.setattr(bf16_gemm, "NATIVE_BF16_GEMM", True)
    own = _step(layer, x, _torchs_own(context))
    native = _step(layer, x, context)
    assert all(torch.equal(a, b) for a, b in zip(native, own))
    monkeypatch.setattr(bf16_gemm, "NATIVE_BF16_GEMM", False)
    routed = _step(layer, x, context)
    # The output: the float32 GEMM (bias in its accumulation) of the bf16 operands, rounded once.
    expected = nn.functional.linear(x.bfloat16().float(), layer.weight.bfloat16().float(), layer.bias.bfloat16().float())
    assert routed[0].dtype == torch.bfloat16 and torch.equal(routed[0], expected.bfloat16())
