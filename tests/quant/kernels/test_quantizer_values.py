"""The GEMM operand the CPU's FP8 quantizers write in their pass (``values=``, issue 38)
against the emulated GEMM's own conversion of the codes in PyTorch ops, bit for bit: every
FP8 rule of the recipes, both axes, both input and operand dtypes, one read for both usages,
a given (delayed) scale, E8M0's smallest and NaN exponents."""

from __future__ import annotations

import pytest
import torch

from fp8train.quant.gemm.emulated import _operand
from fp8train.quant.kernels import fp8 as fp8_kernels
from fp8train.quant.kernels import use_quant_settings
from fp8train.quant.tensor import transpose
from fp8train.recipes import RECIPE_NAMES
from fp8train.spec.recipes import from_name
from fp8train.spec.rule import QuantRule

from .test_operand_kernel import _assert_same_values

RULES = sorted(
    {op.rule for name in RECIPE_NAMES for op in from_name(name).operand_plan.operands if not op.granularity.fp4},
    key=repr,
)
GEMM_DTYPES = [torch.float32, torch.bfloat16]
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
"""``(input dtype, operand dtype)``: as a layer asks (bfloat16 operands for bfloat16 input only)."""


def _name(rule: QuantRule) -> str:
    return f"{rule.granularity}-{rule.format.dtype_name}-{'pow2' if rule.power_2_scales else 'any'}"


def _input(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(2)) * 5
    x[0] *= 2.0**-130  # a row (and blocks) of float32 subnormals: E8M0's smallest exponent
    x[3, 5], x[100, 200] = float("inf"), float("nan")
    return x.to(dtype)


def _expected(qt, values_dtype):
    """The K-last operand of ``qt`` as the emulated GEMM converts it in PyTorch ops."""
    operand = qt if qt.axis == -1 or qt.granularity.symmetric else transpose(qt)
    operand.gemm_cache.values = None  # converted afresh
    return _operand(operand, values_dtype, kernels=False)


def _assert_written(qt, plain, values_dtype):
    assert torch.equal(qt.data.view(torch.uint8), plain.data.view(torch.uint8))
    operand = qt if qt.axis == -1 or qt.granularity.symmetric else transpose(qt)
    cache = operand.gemm_cache
    assert cache.compute_dtype == values_dtype
    expected, out_scale = _expected(plain, values_dtype)
    _assert_same_values(cache.values, expected)
    assert (cache.out_scale is None) == (out_scale is None)
    if out_scale is not None:
        assert torch.equal(cache.out_scale, out_scale)


@pytest.mark.parametrize("rule", RULES, ids=_name)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("x_dtype, values_dtype", DTYPES, ids=str)
def test_one_usage_writes_the_operand_the_gemm_would(rule, axis, x_dtype, values_dtype):
    x = _input(x_dtype)
    with use_quant_settings(quantize_kernel="numba"):
        qt = fp8_kernels.quantize(x, rule, axis, None, values=values_dtype)
        plain = fp8_kernels.quantize(x, rule, axis, None)
    _assert_written(qt, plain, values_dtype)


@pytest.mark.parametrize("rule", [r for r in RULES if not r.granularity.symmetric], ids=_name)
@pytest.mark.parametrize("values", [(torch.float32, torch.bfloat16), (None, torch.float32), (torch.bfloat16, None)], ids=str)
def test_both_usages_from_one_read_write_their_operands(rule, values):
    x = _input(torch.bfloat16)
    with use_quant_settings(quantize_kernel="numba"):
        pair = fp8_kernels.quantize_both(x, rule, None, values=values)
        plain = fp8_kernels.quantize_both(x, rule, None)
    for qt, reference, values_dtype in zip(pair, plain, values):
        if values_dtype is None:
            assert qt.gemm_cache.values is None
            assert torch.equal(qt.data.view(torch.uint8), reference.data.view(torch.uint8))
        else:
            _assert_written(qt, reference, values_dtype)


@pytest.mark.parametrize("values_dtype", GEMM_DTYPES, ids=str)
def test_a_given_scale_leaves_bare_values_and_its_scale_for_the_output(values_dtype):
    rule = from_name("delayed").operand_plan.operands[0].rule
    x, scale = _input(torch.float32), torch.tensor(0.375)
    with use_quant_settings(quantize_kernel="numba"):
        qt = fp8_kernels.quantize(x, rule, -1, scale, values=values_dtype)
        plain = fp8_kernels.quantize(x, rule, -1, scale)
    _assert_written(qt, plain, values_dtype)
    assert torch.equal(qt.gemm_cache.out_scale, 1.0 / scale)


def test_row_scales_that_are_not_powers_of_two_are_refused():
    rule = QuantRule(granularity="row", power_2_scales=False)
    with use_quant_settings(quantize_kernel="numba"), pytest.raises(ValueError, match="not powers of two"):
        fp8_kernels.quantize(_input(torch.float32), rule, -1, None, values=torch.float32)


@pytest.mark.parametrize("granularity", ["mx", "block1x128", "row"])
@pytest.mark.parametrize("shape", [(96, 384), (3, 8192)], ids=str)
def test_row_groups_write_the_operand_whatever_rows_a_task_takes(granularity, shape):
    # The row-group kernel takes rows in tasks of about 8192 elements (96 x 384: 21 a task,
    # the last 12; 3 x 8192: one each); MX's short groups write a row's operand through
    # per-column multipliers, longer groups a group at a time.
    rule = QuantRule(granularity=granularity, power_2_scales=True)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 3
    x[shape[0] - 1] *= 2.0**-130  # the last task's last row: E8M0's smallest exponent
    x[1, 40] = float("nan")
    with use_quant_settings(quantize_kernel="numba"):
        qt = fp8_kernels.quantize(x, rule, -1, None, values=torch.float32)
        plain = fp8_kernels.quantize(x, rule, -1, None)
    _assert_written(qt, plain, torch.float32)
