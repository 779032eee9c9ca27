"""The GEMM a layer's bound kernels call (issue 38): off CUDA the emulation itself; on CUDA a
``BoundCudaGemm`` that makes ``scaled_mm``'s decision once per operand layout. The CUDA one
runs here on CPU tensors with a GPU's facts patched in and the hardware GEMM recorded."""

from __future__ import annotations

import functools

import pytest
import torch

from fp8train.quant import quantize
from fp8train.quant import gemm as gemm_door
from fp8train.quant.gemm import BoundCudaGemm, bound_scaled_mm, scaled_mm
from fp8train.quant.gemm.emulated import emulated_mm
from fp8train.quant.gemm.hardware_support import DeviceFacts
from fp8train.spec.checks import UnsupportedHardwareError

H100 = DeviceFacts("cuda", (9, 0), (12, 8), "NVIDIA H100")


def _operands(granularity="tensor", dtype=torch.float8_e4m3fn, m=32, k=64, n=48):
    generator = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(m, k, generator=generator), granularity, dtype=dtype)
    b = quantize(torch.randn(n, k, generator=generator), granularity, dtype=dtype)
    return a, b


@pytest.fixture
def on_h100(monkeypatch):
    """CPU tensors read as an H100's; ``calls`` records each decision and hardware GEMM."""
    calls = {"decided": 0, "hardware": 0}
    support = gemm_door.hardware_support

    def counted_support(*args):
        calls["decided"] += 1
        return support(*args)

    def hardware_mm(a, b, out_dtype, bias):
        calls["hardware"] += 1
        return emulated_mm(a, b, out_dtype, bias)

    monkeypatch.setattr(gemm_door, "device_facts", lambda device: H100)
    monkeypatch.setattr(gemm_door, "hardware_support", counted_support)
    monkeypatch.setattr(gemm_door, "hardware_mm", hardware_mm)
    return calls


def test_off_cuda_the_bound_gemm_is_the_emulation_with_its_choices_made():
    mm = bound_scaled_mm("auto", "cpu")
    assert isinstance(mm, functools.partial) and mm.func is emulated_mm
    assert mm.keywords["kernels"] is True  # numba is installed with the test extra
    a, b = _operands()
    assert torch.equal(mm(a, b, torch.bfloat16), scaled_mm(a, b, torch.bfloat16))


def test_on_cuda_the_decision_is_made_once_per_layout(on_h100):
    mm = bound_scaled_mm("auto", "cuda")
    assert isinstance(mm, BoundCudaGemm)
    a, b = _operands()
    for _ in range(3):
        out = mm(a, b, torch.bfloat16)
    assert on_h100 == {"decided": 1, "hardware": 3}  # tensorwise on SM 9.0: the hardware
    mm(*_operands(m=64), torch.bfloat16)  # another shape: decided again
    assert on_h100 == {"decided": 2, "hardware": 4}
    assert torch.equal(out, scaled_mm(a, b, torch.bfloat16, backend="emulated"))


def test_on_cuda_a_layout_the_hardware_refuses_runs_emulated(on_h100):
    a, b = _operands(dtype=torch.float8_e5m2)  # no two E5M2 operands in cuBLAS
    out = BoundCudaGemm("auto")(a, b, torch.float32)
    assert on_h100["hardware"] == 0
    assert torch.equal(out, scaled_mm(a, b, torch.float32, backend="emulated"))


def test_on_cuda_the_emulated_backend_never_takes_the_hardware(on_h100):
    BoundCudaGemm("emulated")(*_operands(), torch.bfloat16)
    assert on_h100 == {"decided": 1, "hardware": 0}


def test_on_cuda_the_hardware_backend_raises_as_scaled_mm_does(on_h100):
    a, b = _operands(dtype=torch.float8_e5m2)
    with pytest.raises(UnsupportedHardwareError, match="cuBLAS multiplies no two float8_e5m2 operands") as bound:
        BoundCudaGemm("hardware")(a, b, torch.bfloat16)
    with pytest.raises(UnsupportedHardwareError) as door:
        scaled_mm(a, b, torch.bfloat16, backend="hardware")
    assert str(bound.value) == str(door.value)


def test_an_unknown_backend_is_refused_when_bound():
    with pytest.raises(ValueError, match="backend='fast' must be one of auto, emulated, hardware"):
        bound_scaled_mm("fast", "cpu")
