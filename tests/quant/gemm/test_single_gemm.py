"""The emulated block-scaled GEMM on CUDA as one bfloat16 GEMM with float32 output
(:mod:`fp8train.quant.gemm.single`, issue 40): on a fake CUDA device (PyTorch's
``FakeTensorMode``, no GPU needed) exactly one GEMM runs, ``aten.mm.dtype``, for every
block-scaled family, with and without bias; and its arithmetic, run on CPU tensors with the
CPU's float32 GEMM in place of CUDA's, equals the CPU's emulation bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.quant.fp4_quantize import quantize_fp4
from fp8train.quant.fp8_quantize import quantize_fp8
from fp8train.quant.gemm import emulated
from fp8train.quant.gemm.fp4 import fp4_alpha
from fp8train.quant.gemm.single import one_gemm, one_gemm_runs
from fp8train.quant.kernels import use_quant_settings
from fp8train.quant.tensor import QuantizedTensor, quantized_tensor
from fp8train.spec.rule import QuantRule

GRANULARITIES = ["mx", "nvfp4", "nvfp4_2d", "mxfp4", "tensor"]


def _operands(granularity: str) -> tuple[QuantizedTensor, QuantizedTensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(64, 96, generator=generator) * torch.exp(torch.randn(1, 96, generator=generator))
    b = torch.randn(48, 96, generator=generator)
    rule = QuantRule(granularity=granularity)
    quantize = quantize_fp4 if rule.granularity.fp4 else quantize_fp8
    bias = torch.randn(48, generator=generator)
    return quantize(a, rule, -1, None), quantize(b, rule, -1, None), bias


class _GemmSpy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.gemms: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "mm" in str(func).split(".")[1]:
            self.gemms.append(str(func))
        return func(*args, **(kwargs or {}))


def _on_fake_cuda(qt: QuantizedTensor) -> QuantizedTensor:
    def move(t):  # fake tensors carry no values: a tensor of the same shape and dtype
        return None if t is None else torch.empty(t.shape, dtype=t.dtype, device="cuda")

    moved = quantized_tensor(move(qt.data), move(qt.scale_inv), qt.granularity, qt.axis, qt.power_2_scales, move(qt.global_amax))
    if qt.granularity.fp4:
        # Fake CUDA cannot index the E2M1 table (a host copy): the operand's unpacked values
        # as its cache holds them once converted, so the spy sees the GEMM alone.
        moved.gemm_cache.put(torch.bfloat16, torch.empty(qt.unpacked_shape_2d, dtype=torch.bfloat16, device="cuda"), None)
    return moved


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_one_gemm_per_emulated_product_on_cuda(granularity, out_dtype):
    a, b, bias = _operands(granularity)
    with FakeTensorMode(allow_non_fake_inputs=True):
        a_cuda, b_cuda, bias_cuda = _on_fake_cuda(a), _on_fake_cuda(b), torch.empty(48, device="cuda")
        for with_bias in (None, bias_cuda):
            with _GemmSpy() as spy:
                out = emulated.emulated_mm(a_cuda, b_cuda, out_dtype, with_bias, torch.bfloat16, kernels=False)
            assert spy.gemms == ["aten.mm.dtype"], spy.gemms
            assert out.dtype == out_dtype and out.shape == (64, 48) and out.is_cuda


def test_the_choice_by_device_and_gemm_dtype():
    assert not one_gemm_runs(torch.empty(1), torch.bfloat16)  # the CPU keeps its paths
    with FakeTensorMode():
        cuda = torch.empty(1, device="cuda")
        assert one_gemm_runs(cuda, torch.bfloat16)
        assert not one_gemm_runs(cuda, torch.float32)  # FP8TRAIN_EMULATED_GEMM=float32


def _cpu_product(a_values: torch.Tensor, b_values_t: torch.Tensor) -> torch.Tensor:
    """CUDA's ``mm(bf16, bf16, out_dtype=float32)`` on the CPU: the exact float32 values."""
    return torch.mm(a_values.to(torch.float32), b_values_t.to(torch.float32))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_its_arithmetic_is_the_cpu_emulations_bit_for_bit(granularity, out_dtype):
    a, b, bias = _operands(granularity)
    bias = bias.to(out_dtype)
    with use_quant_settings(quantize_kernel="reference"):
        a_values, a_scale = emulated._operand(a, torch.bfloat16, False)
        b_values, b_scale = emulated._operand(b, torch.bfloat16, False)
        expected = emulated.emulated_mm(a, b, out_dtype, bias, torch.float32, kernels=False)
    actual = one_gemm(a_values, b_values, out_dtype, a_scale, b_scale, fp4_alpha(a, b), bias, product=_cpu_product)
    assert actual.dtype == out_dtype
    assert torch.equal(actual, expected)
