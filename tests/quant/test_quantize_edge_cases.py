"""quantize against NUMERICS.md sections 2-3: edge cases (zeros, inf and NaN groups, tiny
amaxes, empty tensors, layouts, 16-bit inputs), precomputed scales, and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8train.quant import quantize

from ._quantize_reference import (
    ALL_CASES,
    AXES,
    E4M3,
    E5M2,
    _assert_data_equal,
    _bytes,
    _codes,
    _group_shape,
    _oracle_cast,
    _random_normal,
    _reference_quantize,
)


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_all_zero_tensor(granularity, axis, dtype):
    x = torch.zeros(128, 256)
    qt = quantize(x, granularity, axis=axis, dtype=dtype)
    assert not qt.data.view(torch.uint8).any()  # +0 everywhere
    if granularity == "mx":
        # amax 0 -> t 0 -> code 0: scale_inv 2^-127, scale 2^127
        assert not qt.scale_inv.view(torch.uint8).any()
    else:
        assert torch.equal(qt.scale_inv, torch.ones_like(qt.scale_inv))
    assert not qt.dequantize().any()


def _origin_group(granularity: str, axis: int, m: int, k: int) -> tuple[slice, slice]:
    rows, cols = _group_shape(granularity, axis, m, k)
    return slice(0, rows), slice(0, cols)


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
@pytest.mark.parametrize("special", [math.inf, -math.inf])
def test_group_with_inf(granularity, axis, special):
    x = _random_normal((128, 256), seed=1)
    x[0, 0] = special
    qt = quantize(x, granularity, axis=axis)
    rows, cols = _origin_group(granularity, axis, 128, 256)
    codes = _codes(qt)
    assert qt.data[0, 0].item() == math.copysign(448.0, special)
    if granularity == "mx":
        assert qt.scale_inv.view(torch.uint8)[0, 0].item() == 0xFE
        # scale 2^-127: every finite value of the block underflows to zero
        others = qt.data[rows, cols].float().flatten()[1:]
        assert not others.any()
    else:
        first_scale_inv = qt.scale_inv.reshape(-1)[0].item()
        assert first_scale_inv == 1.0
        # scale 1: the group is cast as it is
        np.testing.assert_array_equal(codes[rows, cols], _oracle_cast(x[rows, cols].numpy(), E4M3))
    # other groups are quantized as usual
    data_ref, scale_inv_ref, _ = _reference_quantize(x, granularity, axis, E4M3, granularity != "tensor")
    mask = np.ones((128, 256), dtype=bool)
    mask[rows, cols] = False
    np.testing.assert_array_equal(codes[mask], data_ref[mask])
    if granularity != "tensor":
        np.testing.assert_array_equal(_bytes(qt.scale_inv), _bytes(torch.from_numpy(scale_inv_ref)))


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
def test_group_with_nan(granularity, axis):
    x = _random_normal((128, 256), seed=2) * 300  # some values beyond 448 at scale 1
    x[0, 0] = math.nan
    qt = quantize(x, granularity, axis=axis)
    rows, cols = _origin_group(granularity, axis, 128, 256)
    values = qt.data.float()
    assert math.isnan(values[0, 0].item())
    if granularity == "mx":
        assert qt.scale_inv.view(torch.uint8)[0, 0].item() == 0xFF
        assert torch.isnan(values[rows, cols]).all()  # the whole block is NaN
        assert torch.isnan(qt.dequantize()[rows, cols]).all()
    else:
        assert qt.scale_inv.reshape(-1)[0].item() == 1.0
        # scale 1: every other value of the group is cast unchanged (saturating)
        _assert_data_equal(_codes(qt)[rows, cols], _oracle_cast(x[rows, cols].numpy(), E4M3), E4M3)
    mask = torch.ones(128, 256, dtype=torch.bool)
    mask[rows, cols] = False
    assert not torch.isnan(values[mask]).any()


@pytest.mark.parametrize("granularity", ["block1x128", "block128x128"])
@pytest.mark.parametrize(
    "x_dtype, power_2_scales, expected_scale_inv, expected_data",
    [
        # 448 / 2^-130 overflows: scale = largest float32 -> floored 2^127
        (torch.float32, True, 2.0**-127, 0.125),
        (torch.float32, False, float.fromhex("0x1p-128"), 0.25),
        # bfloat16 input: largest finite bfloat16 0x1.fep+127
        (torch.bfloat16, True, 2.0**-127, 0.125),
        (torch.bfloat16, False, float.fromhex("0x1.0101p-128"), 0.25),
    ],
)
def test_block_tiny_amax_uses_largest_value_of_input_dtype(
    granularity, x_dtype, power_2_scales, expected_scale_inv, expected_data
):
    x = torch.zeros(128, 128, dtype=x_dtype)
    x[0, 0] = 2.0**-130  # exact in float32 and bfloat16 (both subnormal)
    qt = quantize(x, granularity, power_2_scales=power_2_scales)
    assert qt.scale_inv[0, 0].item() == expected_scale_inv
    assert qt.data[0, 0].item() == expected_data  # 2^-130 * scale: 0.125, or 0.249 -> 0.25


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_row_and_tensor_tiny_amax_use_largest_float32(x_dtype):
    x = torch.zeros(1, 128, dtype=x_dtype)
    x[0, 0] = 2.0**-130
    for granularity in ("row", "tensor"):
        qt = quantize(x, granularity, power_2_scales=False)
        assert qt.scale_inv.reshape(-1)[0].item() == float.fromhex("0x1p-128")  # 1 / FLOAT32_MAX
        assert qt.data.reshape(-1)[0].item() == 0.25  # 2^-130 * 0x1.fffffep127 = 0.2499...


def test_float16_tiny_amax_never_overflows_the_scale():
    # The smallest float16 subnormal 2^-24 gives 448 * 2^24 = 1.75 * 2^32: finite, so the
    # largest-float16 replacement (65504, or 2^15 floored) never applies to float16 input.
    x = torch.zeros(128, 128, dtype=torch.float16)
    x[0, 0] = 2.0**-24
    qt = quantize(x, "block1x128")
    assert qt.scale_inv[0, 0].item() == 2.0**-32
    assert qt.data[0, 0].item() == 256.0


@pytest.mark.parametrize(
    "granularity, shape, axis, scale_inv_shape",
    [
        ("tensor", (0,), -1, ()),
        ("tensor", (0, 128), -1, ()),
        ("tensor", (128, 0), -1, ()),
        ("row", (0,), -1, (1, 1)),
        ("row", (0, 128), -1, (0, 1)),
        ("row", (0, 128), 0, (1, 128)),
        ("row", (128, 0), -1, (128, 1)),
        ("row", (128, 0), 0, (1, 0)),
        ("block1x128", (0, 128), -1, (0, 1)),
        ("block1x128", (0, 128), 0, (0, 128)),
        ("block1x128", (128, 0), -1, (128, 0)),
        ("block1x128", (128, 0), 0, (1, 0)),
        ("block1x128", (2, 0, 128), -1, (0, 1)),
        ("block128x128", (0, 128), -1, (0, 1)),
        ("block128x128", (128, 0), 0, (1, 0)),
        ("mx", (0, 32), -1, (0, 1)),
        ("mx", (0, 32), 0, (0, 32)),
        ("mx", (32, 0), -1, (32, 0)),
        ("mx", (32, 0), 0, (1, 0)),
    ],
)
def test_empty_tensors(granularity, shape, axis, scale_inv_shape):
    x = torch.zeros(shape)
    qt = quantize(x, granularity, axis=axis)
    assert qt.data.shape == shape and qt.data.dtype == E4M3
    assert qt.scale_inv.shape == scale_inv_shape
    assert qt.dequantize().shape == shape


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
def test_rank_3_and_non_contiguous_match_contiguous_2d_view(granularity, axis):
    base = _random_normal((256, 2, 128), seed=3) * torch.logspace(-3, 3, 128)
    x3 = base.transpose(0, 1)  # (2, 256, 128), non-contiguous
    assert not x3.is_contiguous()
    x2 = x3.contiguous().reshape(512, 128)
    reference = quantize(x2, granularity, axis=axis)
    for x in (x3, x3.contiguous(), x2.t().contiguous().t()):
        qt = quantize(x, granularity, axis=axis)
        assert qt.data.shape == x.shape
        assert torch.equal(qt.data.reshape(512, 128).view(torch.uint8), reference.data.view(torch.uint8))
        np.testing.assert_array_equal(_bytes(qt.scale_inv), _bytes(reference.scale_inv))
        assert torch.equal(qt.dequantize().reshape(512, 128), reference.dequantize())


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_inputs_match_reference(granularity, axis, x_dtype):
    x = (_random_normal((128, 256), seed=4) * 50).to(x_dtype)
    qt = quantize(x, granularity, axis=axis)
    data_ref, scale_inv_ref, _ = _reference_quantize(x, granularity, axis, E4M3, granularity != "tensor")
    np.testing.assert_array_equal(_codes(qt), data_ref)
    np.testing.assert_array_equal(_bytes(qt.scale_inv), _bytes(torch.from_numpy(scale_inv_ref)))


def test_tensor_granularity_ignores_axis():
    x = _random_normal((64, 32), seed=5)
    a, b = quantize(x, "tensor", axis=-1), quantize(x, "tensor", axis=0)
    assert b.axis == -1
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale_inv, b.scale_inv)


def test_last_dim_index_is_the_same_as_axis_minus_1():
    x = _random_normal((4, 32, 64), seed=6)
    a, b = quantize(x, "row", axis=2), quantize(x, "row", axis=-1)
    assert b.axis == -1 and a.axis == -1
    assert torch.equal(a.scale_inv, b.scale_inv)


# ---------------------------------------------------------------- precomputed scale


@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_precomputed_scale_e4m3(scale_shape):
    x = torch.tensor([1.0, -2.0, 1000.0, math.inf, -math.inf, math.nan, 0.3])
    qt = quantize(x, "tensor", scale=torch.full(scale_shape, 2.0))
    assert qt.scale_inv.shape == () and qt.scale_inv.item() == 0.5
    values = qt.data.float()
    assert values[:5].tolist() == [2.0, -4.0, 448.0, 448.0, -448.0]
    assert math.isnan(values[5].item())
    assert values[6].item() == 0.625  # 0.6 -> nearest E4M3 (spacing 1/16 in [0.5, 1))


def test_precomputed_scale_e5m2_saturates_instead_of_overflowing():
    x = torch.tensor([[1000.0, 1e5, math.inf, 3.0]])
    qt = quantize(x, "tensor", dtype=E5M2, scale=torch.tensor(2.0))
    assert qt.data.float().tolist() == [[2048.0, 57344.0, 57344.0, 6.0]]
    # Also a scale that is not a power of two, with the float32 rounding of x * scale.
    qt = quantize(x, "tensor", dtype=E5M2, scale=torch.tensor(0.1, dtype=torch.float64))
    data_ref = _oracle_cast((x.numpy() * np.float32(0.1)).astype(np.float32), E5M2)
    np.testing.assert_array_equal(_codes(qt), data_ref)
    assert qt.scale_inv.item() == float(np.float32(1) / np.float32(0.1))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("granularity", ["block1x128", "block128x128", "mx"])
def test_rank_1_rejected_for_block_and_mx(granularity):
    message = rf"granularity '{granularity}' needs a tensor of rank >= 2, got shape \(256,\)"
    with pytest.raises(ValueError, match=message):
        quantize(torch.ones(256), granularity)


def test_rank_0_rejected_for_row():
    with pytest.raises(ValueError, match=r"granularity 'row' needs a tensor of rank >= 1, got shape \(\)"):
        quantize(torch.tensor(1.0), "row")


@pytest.mark.parametrize(
    "granularity, shape, message",
    [
        ("block1x128", (100, 128), r"by 128; shape \(100, 128\) gives 100 x 128"),
        ("block1x128", (128, 100), r"by 128; shape \(128, 100\) gives 128 x 100"),
        ("block1x128", (3, 50, 128), r"by 128; shape \(3, 50, 128\) gives 150 x 128"),
        ("block128x128", (128, 192), r"by 128; shape \(128, 192\) gives 128 x 192"),
        ("block128x128", (64, 128), r"by 128; shape \(64, 128\) gives 64 x 128"),
        ("mx", (32, 48), r"by 32; shape \(32, 48\) gives 32 x 48"),
        ("mx", (2, 8, 32), r"by 32; shape \(2, 8, 32\) gives 16 x 32"),
    ],
)
@pytest.mark.parametrize("axis", AXES)
def test_indivisible_shapes_name_the_shape(granularity, shape, message, axis):
    with pytest.raises(ValueError, match=message):
        quantize(torch.ones(shape), granularity, axis=axis)


@pytest.mark.parametrize("granularity", ["block", "rowwise", "TENSOR", "", "1x128"])
def test_bad_granularity(granularity):
    with pytest.raises(ValueError, match=rf"granularity='{granularity}' is not one of tensor, row, "):
        quantize(torch.ones(128, 128), granularity)


@pytest.mark.parametrize("shape, axis", [((128, 128), 2), ((128, 128), -2), ((2, 64, 128), 1), ((128,), 1)])
def test_bad_axis(shape, axis):
    with pytest.raises(ValueError, match=rf"axis={axis} is not supported for a rank-{len(shape)} input"):
        quantize(torch.ones(shape), "row", axis=axis)


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float16, torch.float8_e4m3fnuz, torch.int8])
def test_bad_fp8_dtype(dtype):
    with pytest.raises(ValueError, match=rf"dtype={dtype} is not an FP8 data dtype"):
        quantize(torch.ones(128, 128), "tensor", dtype=dtype)


@pytest.mark.parametrize("x_dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_bad_input_dtype(x_dtype):
    with pytest.raises(ValueError, match=rf"quantize takes float32, bfloat16 or float16 input, got {x_dtype}"):
        quantize(torch.ones(128, 128).to(x_dtype), "tensor")


@pytest.mark.parametrize("granularity", ["row", "block1x128", "block128x128", "mx"])
def test_precomputed_scale_only_for_tensor(granularity):
    message = rf"precomputed scale is only supported for granularity 'tensor', not '{granularity}'"
    with pytest.raises(ValueError, match=message):
        quantize(torch.ones(128, 128), granularity, scale=torch.tensor(1.0))


def test_mx_rejects_power_2_scales_false():
    with pytest.raises(ValueError, match=r"power_2_scales=False is not possible for 'mx'"):
        quantize(torch.ones(32, 32), "mx", power_2_scales=False)
    assert quantize(torch.ones(32, 32), "mx", power_2_scales=True).scale_inv.shape == (32, 1)


def test_mx_rejects_unknown_scale_rule():
    with pytest.raises(ValueError, match=r"rule='floor' must be 'ceil' or 'ocp'"):
        quantize(torch.ones(32, 32), "mx", mx_scale_rule="floor")
