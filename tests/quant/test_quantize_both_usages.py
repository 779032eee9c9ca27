"""quantize_both_usages: both usages of a role from one read, equal to two quantize_usage
calls (on the reference path) for every recipe's plan, role and input dtype; and the fused
kernel runs exactly where the plan quantizes both usages by one rule that a fused kernel
takes."""

from __future__ import annotations

import pytest
import torch

from fp8train.quant.kernels import fp8 as fp8_kernels
from fp8train.quant.kernels import use_quant_settings
from fp8train.quant.operand import quantize_both_usages, quantize_usage
from fp8train.recipes import RECIPE_NAMES, from_name
from fp8train.spec.roles import Usage

PAIRS = [
    (Usage.OUTPUT_INPUT, Usage.GRAD_WEIGHT_INPUT),
    (Usage.GRAD_INPUT_GRAD_OUTPUT, Usage.GRAD_WEIGHT_GRAD_OUTPUT),
]
# Recipes whose input and grad_output take the fused kernel: the same rule in both usages,
# groups one value across (row, 1x128, MX). Per-tensor scales are one quantization
# transposed (tensorwise) or a given scale (delayed); no grad_weight GEMM: no pair.
FUSED = {"rowwise", "blockwise", "mxfp8"}


def _same(a, b):
    assert (a.granularity, a.axis, a.power_2_scales) == (b.granularity, b.axis, b.power_2_scales)
    assert a.data.shape == b.data.shape and a.data.stride() == b.data.stride()
    assert a.scale_inv.dtype == b.scale_inv.dtype and a.scale_inv.shape == b.scale_inv.shape
    for x, y in ((a.data, b.data), (a.scale_inv, b.scale_inv)):
        assert torch.equal(_bytes(x), _bytes(y))
    assert (a.global_amax is None) == (b.global_amax is None)
    assert a.global_amax is None or torch.equal(a.global_amax, b.global_amax)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Byte-sized dtypes (FP8, packed 4-bit, E8M0) view as uint8 at any stride.
    return t.view(torch.uint8).reshape(-1) if t.element_size() == 1 else t.reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("last, first", PAIRS, ids=["input", "grad_output"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_pair_equals_two_calls(monkeypatch, recipe, last, first, dtype):
    plan = from_name(recipe).operand_plan
    if not plan.quantizes_usage(first):
        pytest.skip(f"{recipe} runs the grad_weight GEMM in high precision")
    fused_calls = []

    def spy(x2d, rule, *values):
        fused_calls.append(rule)
        return fused(x2d, rule, *values)

    fused = fp8_kernels.quantize_both_usages
    monkeypatch.setattr(fp8_kernels, "quantize_both_usages", spy)
    x = (torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    scale = torch.tensor(0.75) if recipe == "delayed" else None
    torch.manual_seed(0)  # nvfp4's stochastic rounding: the same draws for both paths
    with use_quant_settings(quantize_kernel="numba"):
        pair = quantize_both_usages(plan, last, first, x, scale)
    assert fused_calls == ([plan.operand(last).rule] if recipe in FUSED else [])
    torch.manual_seed(0)
    with use_quant_settings(quantize_kernel="reference"):
        last_qt = quantize_usage(plan, last, x, scale)
        first_qt = quantize_usage(plan, first, x, scale, last_qt)
    _same(pair[0], last_qt)
    _same(pair[1], first_qt)
