"""Bad arguments to the quant layer's public functions: a typed error that names the
argument and the value."""

import math

import numpy as np
import pytest
import torch

import fp8train
from fp8train.quant import QuantizedTensor, quantize, scaled_mm

X = torch.randn(128, 128)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: fp8train.quant.cast_to_fp8([1.0, 2.0], torch.float8_e4m3fn), TypeError, r"x must be a torch.Tensor, got list"),
        (lambda: fp8train.quant.cast_to_fp8(np.ones(4, np.float32), torch.float8_e4m3fn), TypeError, r"got ndarray.*torch.as_tensor"),
        (lambda: quantize(np.ones((32, 32)), "tensor"), TypeError, r"x must be a torch.Tensor, got ndarray"),
        (lambda: quantize(X, "tile"), ValueError, r"granularity='tile' is not one of tensor, row"),
        (lambda: quantize(X, "row", axis=True), TypeError, r"axis=True must be an int"),
        (lambda: quantize(X, "row", axis=1.0), TypeError, r"axis=1.0 must be an int"),
        (lambda: quantize(X, "row", power_2_scales="yes"), TypeError, r"power_2_scales='yes' must be True or False"),
        (lambda: quantize(X, "row", amax_epsilon=-1.0), ValueError, r"amax_epsilon=-1.0 must be a finite number >= 0"),
        (lambda: quantize(X, "row", amax_epsilon=math.nan), ValueError, r"amax_epsilon=nan must be a finite number"),
        (lambda: quantize(X, "tensor", scale=2.0), TypeError, r"scale must be a torch.Tensor, got float"),
        (lambda: quantize(X, "tensor", scale=torch.ones(2)), ValueError, r"scale must be a one-element floating-point tensor, got shape \(2,\)"),
        (lambda: quantize(X, "tensor", scale=torch.ones(1, dtype=torch.int32)), ValueError, r"one-element floating-point tensor.*torch.int32"),
        (lambda: quantize(X, "row", mx_scale_rule="floor"), ValueError, r"mx_scale_rule='floor' must be 'ceil' or 'ocp'"),
        (lambda: fp8train.quant.amax_to_scale([1.0], 448.0), TypeError, r"amax must be a torch.Tensor"),
        (lambda: fp8train.quant.amax_to_scale(torch.ones(1), 0.0), ValueError, r"fp8_max=0.0 must be a finite number > 0"),
        (lambda: fp8train.quant.amax_to_scale(torch.ones(1), math.inf), ValueError, r"fp8_max=inf must be a finite number > 0"),
        (lambda: fp8train.quant.amax_to_scale(torch.ones(1), 448.0, power_2_scales=1), TypeError, r"power_2_scales=1 must be True or False"),
        (lambda: fp8train.quant.amax_to_scale(torch.ones(1), 448.0, amax_epsilon=-1), ValueError, r"amax_epsilon=-1 must be a finite number >= 0"),
        (lambda: fp8train.quant.delayed_scaling_update(torch.zeros(4), torch.ones(()), 448.0, margin=-1), ValueError, r"margin=-1 must be an int >= 0"),
        (lambda: fp8train.quant.delayed_scaling_update(torch.zeros(4), torch.ones(()), -448.0), ValueError, r"fp8_max=-448.0 must be a finite number > 0"),
        (lambda: fp8train.quant.delayed_scaling_update([0.0], torch.ones(()), 448.0), TypeError, r"amax_history must be a torch.Tensor"),
    ],
)
def test_bad_quantization_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_quantize_takes_a_rule_and_the_public_one_builds_it():
    from fp8train.quant.quantize import quantize as quantize_by_rule
    from fp8train.quant.quantize import quantize_both
    from fp8train.spec import E5M2, QuantRule

    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 1e3
    rule = QuantRule(granularity="mx", format=E5M2, amax_epsilon=1e-3, mx_scale_rule="ocp")
    by_rule = quantize_by_rule(x, rule, axis=0)
    public = quantize(x, "mx", dtype=torch.float8_e5m2, axis=0, amax_epsilon=1e-3, mx_scale_rule="ocp")
    assert (by_rule.granularity, by_rule.axis, by_rule.power_2_scales) == (public.granularity, 0, True)
    assert torch.equal(by_rule.data.view(torch.uint8), public.data.view(torch.uint8))
    assert torch.equal(by_rule.scale_inv.view(torch.uint8), public.scale_inv.view(torch.uint8))
    for call in (lambda: quantize_by_rule(x, "mx"), lambda: quantize_both(x, "mx")):
        with pytest.raises(TypeError, match=r"rule must be a QuantRule \(fp8train.spec.QuantRule\), got str"):
            call()


def _fp8(shape=(4, 4)):
    return torch.zeros(shape, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(data=torch.zeros(4, 4), scale_inv=torch.tensor(1.0), granularity="tensor"), ValueError, r"data must be float8_e4m3fn or float8_e5m2, got torch.float32"),
        (dict(data=[0.0], scale_inv=torch.tensor(1.0), granularity="tensor"), TypeError, r"data must be a torch.Tensor, got list"),
        (dict(data=_fp8(), scale_inv=1.0, granularity="tensor"), TypeError, r"scale_inv must be a torch.Tensor, got float"),
        (dict(data=_fp8(), scale_inv=torch.tensor(1.0), granularity="tensor", axis=1), ValueError, r"axis=1 must be -1 \(rowwise usage\) or 0"),
        (dict(data=_fp8(), scale_inv=torch.tensor(1.0), granularity="tensor", power_2_scales=None), TypeError, r"power_2_scales=None must be True or False"),
    ],
)
def test_bad_quantized_tensor_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantizedTensor(**kwargs)


def test_bad_gemm_and_layout_arguments():
    a = quantize(torch.randn(32, 64), "tensor")
    b = quantize(torch.randn(16, 64), "tensor")
    with pytest.raises(TypeError, match=r"a must be a QuantizedTensor \(from fp8train.quant.quantize\), got Tensor"):
        scaled_mm(torch.randn(32, 64), b)
    with pytest.raises(TypeError, match=r"bias must be a torch.Tensor, got list"):
        scaled_mm(a, b, bias=[0.0] * 16)
    with pytest.raises(ValueError, match=r"bias of shape \(32,\) must be \[N\] = \[16\]"):
        scaled_mm(a, b, bias=torch.zeros(32))
    with pytest.raises(TypeError, match=r"qt must be a QuantizedTensor"):
        fp8train.quant.blockwise_to_gemm_layout(torch.randn(128, 128))
    data, scales = fp8train.quant.blockwise_to_gemm_layout(quantize(torch.randn(128, 256), "block1x128"))
    with pytest.raises(ValueError, match=r"axis=2 must be -1 \(rowwise\) or 0 \(columnwise\)"):
        fp8train.quant.blockwise_from_gemm_layout(data, scales, granularity="block1x128", axis=2)
    with pytest.raises(TypeError, match=r"scale_inv must be a torch.Tensor"):
        fp8train.quant.blockwise_from_gemm_layout(data, scales.tolist(), granularity="block1x128", axis=-1)
    with pytest.raises(TypeError, match=r"scale_inv must be a torch.Tensor, got list"):
        fp8train.quant.swizzle_mx_scales([[1]])
