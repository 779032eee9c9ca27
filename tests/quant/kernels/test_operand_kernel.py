"""The emulated GEMM's operand kernel (kernels.scaled_fp8_values) against the PyTorch ops
it replaces, bit for bit: every code of both formats, extreme power-of-two scales, every
granularity and axis, both GEMM dtypes, transposed operands."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8train.quant.kernels import operands
from fp8train.quant.cast import e8m0_to_float32, fp8_to_hp
from fp8train.quant.gemm.emulated import _operand
from fp8train.quant import quantize
from fp8train.quant.tensor import transpose

from .._quantize_reference import ALL_CASES, E4M3, E5M2

GEMM_DTYPES = [torch.bfloat16, torch.float32]


def _reference(codes: torch.Tensor, scale_inv: torch.Tensor, group, out_dtype) -> torch.Tensor:
    rows, cols = group
    m, n = codes.shape
    values = fp8_to_hp(codes, out_dtype).reshape(m // rows, rows, n // cols, cols)
    scales = scale_inv.to(out_dtype).reshape(m // rows, 1, n // cols, 1)
    return (values * scales).reshape(m, n)


def _assert_same_values(actual: torch.Tensor, expected: torch.Tensor):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), "NaN positions differ"  # a NaN's sign is open
    int_dtype = torch.int16 if actual.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(actual[~nan].view(int_dtype), expected[~nan].view(int_dtype))


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("out_dtype", GEMM_DTYPES, ids=str)
def test_every_code_times_extreme_scales(fp8_dtype, out_dtype):
    # 256 codes per row; one power-of-two scale per row from 2^-127 (subnormal float32,
    # E8M0's smallest) to 2^127, plus NaN (an MX block that held a NaN) and 1.
    exponents = list(range(-127, 128, 3)) + [127, 0]
    codes = torch.arange(256, dtype=torch.uint8).repeat(len(exponents) + 1, 1).view(fp8_dtype)
    scales = [2.0**e for e in exponents] + [float("nan")]
    scale_inv = torch.tensor(scales, dtype=torch.float32).reshape(-1, 1)
    actual = operands.scaled_fp8_values(codes, scale_inv, (1, 256), out_dtype)
    _assert_same_values(actual, _reference(codes, scale_inv, (1, 256), out_dtype))


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("out_dtype", GEMM_DTYPES, ids=str)
def test_operands_match_the_pytorch_ops(kernel_choice, granularity, axis, fp8_dtype, out_dtype):
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(1)) * 7
    x[3, 5], x[100, 200] = float("inf"), float("nan")
    qt = quantize(x, granularity, axis=axis, dtype=fp8_dtype)
    for operand in (qt, transpose(qt)):
        kernel_choice("numba")
        fast, fast_scale = _operand(dataclasses.replace(operand), out_dtype)  # a fresh gemm_cache
        kernel_choice("reference")
        reference, reference_scale = _operand(dataclasses.replace(operand), out_dtype)
        _assert_same_values(fast, reference)
        assert fast.stride() == reference.stride() or fast.is_contiguous() == reference.is_contiguous()
        assert (fast_scale is None) == (reference_scale is None)


@pytest.mark.parametrize(
    "layout",
    ["contiguous", "transposed", "one_row", "one_column", "one_row_transposed", "strided"],
)
def test_any_layout_of_codes_converts_as_the_pytorch_ops(layout):
    # The kernel reads contiguous memory: a transposed view is read in memory order and
    # comes back transposed, anything else is copied first (size-1 dims have any stride).
    base = torch.arange(256, dtype=torch.uint8).repeat(2, 2)[:, :384].contiguous().view(E4M3)  # [512, 384]
    codes = {
        "contiguous": base[:64, :128],
        "transposed": base[:128, :64].t(),
        "one_row": base[:1, :128],
        "one_column": base[:64, :1],
        "one_row_transposed": base[:128, :1].t(),
        "strided": base[:64, ::3],
    }[layout]
    codes = codes if layout != "contiguous" else codes.contiguous()
    scale_inv = torch.full((1, 1), 0.5)
    kernel_choice_values = operands.scaled_fp8_values(codes, scale_inv, tuple(codes.shape), torch.float32)
    _assert_same_values(kernel_choice_values, _reference(codes, scale_inv, tuple(codes.shape), torch.float32))


@pytest.mark.parametrize("out_dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["last_dim", "first_dim"])
def test_every_e8m0_scale_code_decodes_in_the_kernel_as_the_reference(out_dtype, transposed):
    # MX operands keep their E8M0 codes; the kernel decodes them (issue 38): every code,
    # 2^-127 (subnormal float32) to 2^127 and NaN (255), against e8m0_to_float32.
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(E4M3)  # every FP8 code in every row
    scale_codes = torch.arange(256, dtype=torch.uint8).reshape(256, 1).view(torch.float8_e8m0fnu)
    group = (1, 256)
    if transposed:  # a first-dim operand: the codes and the scales come transposed
        codes, scale_codes, group = codes.t(), scale_codes.t(), (256, 1)
    mx = quantize(torch.ones(32, 32), "mx", axis=0 if transposed else -1)
    qt = dataclasses.replace(mx, data=codes, scale_inv=scale_codes)
    actual = operands.operand_values(qt, True, out_dtype)
    expected_scales = e8m0_to_float32(scale_codes.view(torch.uint8))
    _assert_same_values(actual, _reference(codes, expected_scales, group, out_dtype))
