"""The emulated 4-bit GEMM's operand (E2M1 values times their block scales, folded): the
numba kernel against the PyTorch ops bit for bit, every granularity, both orientations of
a K-last operand, both GEMM dtypes, every input class; and the kernel is what runs on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fp8train
from fp8train.quant.kernels import operands
from fp8train.quant.gemm.fp4 import fp4_operand_values
from fp8train.quant.kernels import use_quant_settings
from fp8train.quant.tensor import transpose


def _input(kind: str) -> torch.Tensor:
    """``random``: values over 12 decades with zero rows, signed zeros and (MXFP4) blocks whose
    E8M0 scale is subnormal in float32 (NVFP4's scales are relative to the global amax);
    ``nan``: the same with a NaN (NVFP4: every scale NaN; MXFP4: one block)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen) * torch.logspace(-6, 6, 96)
    x[3] = 0.0
    x[5, :32] = -0.0
    x[40:48] *= 2.0**-120
    if kind == "nan":
        x[7, 40] = float("nan")
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bits, every NaN as one pattern (the payload is not part of the contract)."""
    t = t.float()
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)


@pytest.mark.parametrize("kind", ["random", "nan"])
@pytest.mark.parametrize("granularity", ["nvfp4", "nvfp4_2d", "mxfp4"])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_kernel_equals_pytorch_ops(monkeypatch, kind, granularity, axis, dtype):
    qt = fp8train.quant.quantize(_input(kind), granularity, axis=axis)
    if axis == 0 and granularity != "nvfp4_2d":
        qt = transpose(qt)  # a K-last operand whose bytes are stored transposed
        assert not qt.data.is_contiguous()
    calls = []
    kernel, *scale_values = operands._fold_kernel()
    monkeypatch.setattr(operands, "_fold_kernel", lambda: (lambda *args: calls.append(1) or kernel(*args), *scale_values))
    with use_quant_settings(quantize_kernel="numba"):
        fast = fp4_operand_values(transpose(transpose(qt)), dtype)
    with use_quant_settings(quantize_kernel="reference"):
        reference = fp4_operand_values(transpose(transpose(qt)), dtype)
    assert calls == [1]
    assert fast.dtype == reference.dtype == dtype and fast.shape == reference.shape == qt.unpacked_shape_2d
    assert torch.equal(_bits(fast), _bits(reference))
    # And the values are the operand's dequantized codes: x ~= values (times gd for NVFP4).
    if kind == "random" and dtype == torch.float32:
        expected = qt.dequantize() if axis == -1 or granularity == "nvfp4_2d" else transpose(qt).dequantize().t()
        if qt.global_amax is not None:
            from fp8train.quant.scaling import nvfp4_global_scales

            expected = expected / nvfp4_global_scales(qt.global_amax)[1]
        torch.testing.assert_close(fast.float(), expected, rtol=2e-7, atol=0)


def test_the_operand_is_cached_for_the_backward():
    qt = fp8train.quant.quantize(_input("random"), "nvfp4_2d")
    first = fp4_operand_values(qt, torch.float32)
    assert fp4_operand_values(qt, torch.float32) is first
    assert torch.equal(fp4_operand_values(transpose(qt), torch.float32), first.t())


@pytest.mark.parametrize("granularity, axis", [("nvfp4", 0), ("nvfp4_2d", -1), ("mxfp4", -1)])
def test_float32_operand_equals_pytorch_ops_and_the_dequantized_values(monkeypatch, granularity, axis):
    test_kernel_equals_pytorch_ops(monkeypatch, "random", granularity, axis, torch.float32)


def test_strided_scales_are_read_contiguous_and_strided_codes_go_to_pytorch_ops():
    qt = fp8train.quant.quantize(_input("random"), "mxfp4")
    with use_quant_settings(quantize_kernel="reference"):
        reference = fp4_operand_values(transpose(transpose(qt)), torch.float32)
    # Scales that are a slice of a wider tensor: neither contiguous nor a contiguous transpose.
    wide = torch.zeros(qt.scale_inv.shape[0], 2 * qt.scale_inv.shape[1], dtype=qt.scale_inv.dtype)
    wide[:, ::2] = qt.scale_inv
    strided = dataclasses.replace(qt, scale_inv=wide[:, ::2])
    assert torch.equal(_bits(operands.try_fp4_operand_values(strided, torch.float32, True)), _bits(reference))
    wide = torch.zeros(qt.data.shape[0], 2 * qt.data.shape[1], dtype=torch.uint8)
    wide[:, ::2] = qt.data.view(torch.uint8)
    codes = dataclasses.replace(qt, data=wide[:, ::2].view(torch.float4_e2m1fn_x2))
    assert operands.try_fp4_operand_values(codes, torch.float32, True) is None
    assert torch.equal(_bits(fp4_operand_values(codes, torch.float32)), _bits(reference))


def test_the_kernels_scale_tables_decode_every_code_as_the_reference():
    # The tables both 4-bit operand paths fold with (the quantizers' pass and the fold of
    # restored codes): every E4M3 and E8M0 code's float32 bits, NaNs included.
    numba_fp4_values = pytest.importorskip("fp8train.quant.kernels.numba_fp4_values")
    from fp8train.quant.scaling import e8m0_to_float32

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    e4m3 = codes.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(torch.from_numpy(numba_fp4_values.E4M3_VALUES).view(torch.int32), e4m3.view(torch.int32))
    e8m0 = e8m0_to_float32(codes)
    assert torch.equal(torch.from_numpy(numba_fp4_values.E8M0_VALUES).view(torch.int32), e8m0.view(torch.int32))
