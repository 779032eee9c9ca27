"""quantize / QuantizedTensor against NUMERICS.md sections 2-3: shapes and dtypes, and
hand-computed examples. Edge cases and errors are in test_quantize_edge_cases.py, property
tests against the numpy/ml_dtypes reference in test_quantize_properties.py."""

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
    _group_shape,
    _random_normal,
    _scale_inv_shape,
)



# ---------------------------------------------------------------- shapes and dtypes


@pytest.mark.parametrize("granularity, axis", ALL_CASES)
@pytest.mark.parametrize("shape", [(256, 384), (2, 64, 128)])
def test_shapes_and_dtypes(granularity, axis, shape):
    x = _random_normal(shape)
    qt = quantize(x, granularity, axis=axis)
    m, k = math.prod(shape[:-1]), shape[-1]
    assert qt.data.shape == shape and qt.shape == shape
    assert qt.data.dtype == E4M3 and qt.dtype == E4M3
    assert qt.scale_inv.shape == _scale_inv_shape(granularity, axis, m, k)
    assert qt.scale_inv.dtype == (torch.float8_e8m0fnu if granularity == "mx" else torch.float32)
    assert qt.granularity == granularity
    assert qt.axis == (-1 if granularity == "tensor" else axis)
    assert qt.group_shape == _group_shape(granularity, axis, m, k)
    assert quantize(x, granularity, axis=axis, dtype=E5M2).data.dtype == E5M2
    assert qt.dequantize().dtype == torch.float32 and qt.dequantize().shape == shape
    assert qt.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_compact_scale_shapes_by_hand():
    x = torch.ones(256, 384)
    expected = {
        ("tensor", -1): (),
        ("row", -1): (256, 1),
        ("row", 0): (1, 384),
        ("block1x128", -1): (256, 3),
        ("block1x128", 0): (2, 384),
        ("block128x128", -1): (2, 3),
        ("block128x128", 0): (2, 3),
        ("mx", -1): (256, 12),
        ("mx", 0): (8, 384),
    }
    for (granularity, axis), shape in expected.items():
        assert quantize(x, granularity, axis=axis).scale_inv.shape == shape, (granularity, axis)


# ---------------------------------------------------------------- hand-computed examples


def _sparse(shape, entries: dict, dtype=torch.float32) -> torch.Tensor:
    x = torch.zeros(shape, dtype=torch.float32)
    for index, value in entries.items():
        x[index] = value
    return x.to(dtype)


def test_tensor_hand_example():
    x = _sparse((32, 64), {(0, 0): 3.0, (1, 2): -1.5, (3, 4): 0.25, (5, 6): 0.1})
    qt = quantize(x, "tensor")
    # scale = float32(448 / 3) = 0x1.2aaaaap+7; scale_inv = float32(1 / scale)
    assert qt.scale_inv.item() == float.fromhex("0x1.b6db6ep-8")
    # 3 -> 447.99999 -> 448; -1.5 -> -224; 0.25 -> 37.33 -> 36; 0.1 -> 14.93 -> 15
    expected = _sparse((32, 64), {(0, 0): 448.0, (1, 2): -224.0, (3, 4): 36.0, (5, 6): 15.0})
    assert torch.equal(qt.data.float(), expected)

    pow2 = quantize(x, "tensor", power_2_scales=True)
    assert pow2.scale_inv.item() == 2.0**-7  # 149.33 floors to 128
    expected = _sparse((32, 64), {(0, 0): 384.0, (1, 2): -192.0, (3, 4): 32.0, (5, 6): 13.0})
    assert torch.equal(pow2.data.float(), expected)
    assert pow2.dequantize()[5, 6].item() == 13.0 / 128


ROW_EXAMPLE = {(0, 0): 1.0, (0, 1): -0.5, (1, 0): 3.0, (1, 1): 1.0, (3, 0): 500.0, (3, 1): 50.0}
# row amaxes 1, 3, 0, 500 -> scales 448, 149.3, 1, 0.896 -> floored 256, 128, 1, 0.5
ROW_SCALE_INV = [2.0**-8, 2.0**-7, 1.0, 2.0]
# 500 * 0.5 = 250 -> 256; 50 * 0.5 = 25, a tie between 24 (mantissa 100) and 26 -> 24
ROW_DATA = {(0, 0): 256.0, (0, 1): -128.0, (1, 0): 384.0, (1, 1): 128.0, (3, 0): 256.0, (3, 1): 24.0}


def test_row_hand_example_both_axes():
    x = _sparse((4, 8), ROW_EXAMPLE)
    qt = quantize(x, "row")
    assert qt.scale_inv.tolist() == [[v] for v in ROW_SCALE_INV]
    assert torch.equal(qt.data.float(), _sparse((4, 8), ROW_DATA))

    qt_columnwise = quantize(x.t().contiguous(), "row", axis=0)
    assert qt_columnwise.scale_inv.tolist() == [ROW_SCALE_INV]
    assert torch.equal(qt_columnwise.data.float(), _sparse((4, 8), ROW_DATA).t())


def test_row_ties_to_even():
    # amax 500 -> scale 0.5: 100 * 0.5 = 50 is a tie between 48 (mantissa 100) and 52 -> 48
    x = torch.tensor([[500.0, 100.0, 116.0]])
    assert quantize(x, "row").data.float().tolist() == [[256.0, 48.0, 56.0]]


def test_block1x128_hand_example_both_axes():
    x = _sparse(
        (128, 256),
        {(0, 0): 3.0, (0, 200): 0.5, (5, 130): 1000.0, (5, 131): 1.0, (127, 255): -448.0},
    )
    qt = quantize(x, "block1x128")
    expected_scale_inv = torch.ones(128, 2)
    expected_scale_inv[0, 0] = 2.0**-7  # amax 3 -> 149.3 -> 128
    expected_scale_inv[0, 1] = 2.0**-9  # amax 0.5 -> 896 -> 512
    expected_scale_inv[5, 1] = 4.0  # amax 1000 -> 0.448 -> 0.25
    assert torch.equal(qt.scale_inv, expected_scale_inv)
    expected = _sparse(
        (128, 256),
        {(0, 0): 384.0, (0, 200): 256.0, (5, 130): 256.0, (5, 131): 0.25, (127, 255): -448.0},
    )
    assert torch.equal(qt.data.float(), expected)

    qt = quantize(x, "block1x128", axis=0)
    expected_scale_inv = torch.ones(1, 256)
    expected_scale_inv[0, 0] = 2.0**-7
    expected_scale_inv[0, 200] = 2.0**-9
    expected_scale_inv[0, 130] = 4.0
    expected_scale_inv[0, 131] = 2.0**-8  # column 131 alone: amax 1
    assert torch.equal(qt.scale_inv, expected_scale_inv)
    expected[5, 131] = 256.0
    assert torch.equal(qt.data.float(), expected)


@pytest.mark.parametrize("axis", AXES)
def test_block128x128_hand_example(axis):
    x = _sparse((256, 384), {(3, 7): 3.0, (200, 300): 1000.0, (255, 383): 7.0, (100, 200): -0.4375})
    qt = quantize(x, "block128x128", axis=axis)
    expected_scale_inv = torch.tensor(
        [
            [2.0**-7, 2.0**-10, 1.0],  # tile (0,1): 448 / 0.4375 = 1024
            [1.0, 1.0, 4.0],  # tile (1,2): amax 1000 -> 0.25
        ]
    )
    assert torch.equal(qt.scale_inv, expected_scale_inv)
    expected = _sparse((256, 384), {(3, 7): 384.0, (200, 300): 256.0, (255, 383): 1.75, (100, 200): -448.0})
    assert torch.equal(qt.data.float(), expected)


def _next_float32_up(value: float) -> float:
    return float(np.nextafter(np.float32(value), np.float32(np.inf)))


MX_EXAMPLE = {
    (0, 5): 448.0,  # t = 1 exactly: code 127
    (0, 40): 1.0,  # code 119: scale_inv 2^-8
    (1, 0): 449.0,  # code 128: 224.5 -> 224
    (1, 1): 3.0,
    (2, 33): 896.0,  # 448 * 2 exactly: code 128, no round-up
    (3, 0): _next_float32_up(896.0),  # just above: code 129
}
MX_CODES = {(0, 0): 127, (0, 1): 119, (1, 0): 128, (2, 1): 128, (3, 0): 129}
MX_DATA = {(0, 5): 448.0, (0, 40): 256.0, (1, 0): 224.0, (1, 1): 1.5, (2, 33): 448.0, (3, 0): 224.0}


def test_mx_hand_example_both_axes():
    x = _sparse((32, 64), MX_EXAMPLE)
    qt = quantize(x, "mx")
    expected_codes = torch.zeros(32, 2, dtype=torch.uint8)
    for index, code in MX_CODES.items():
        expected_codes[index] = code
    assert torch.equal(qt.scale_inv.view(torch.uint8), expected_codes)
    assert torch.equal(qt.data.float(), _sparse((32, 64), MX_DATA))
    assert qt.dequantize()[3, 0].item() == 224.0 * 4

    qt = quantize(x.t().contiguous(), "mx", axis=0)
    assert torch.equal(qt.scale_inv.view(torch.uint8), expected_codes.t())
    assert torch.equal(qt.data.float(), _sparse((32, 64), MX_DATA).t())


def test_mx_ocp_rule_may_saturate():
    x = torch.zeros(32, 32)
    x[0, 0] = 480.0
    x[1, 0] = 1.0
    ceil = quantize(x, "mx")
    ocp = quantize(x, "mx", mx_scale_rule="ocp")
    # ceil: 480 / 448 > 1 -> code 128, 480 / 2 = 240; ocp: floor(log2 480) - 8 = 0 -> 127, 480 saturates
    assert ceil.scale_inv.view(torch.uint8).flatten().tolist()[:3] == [128, 119, 0]
    assert ocp.scale_inv.view(torch.uint8).flatten().tolist()[:3] == [127, 119, 0]
    assert ceil.data[0, 0].item() == 240.0
    assert ocp.data[0, 0].item() == 448.0
    assert ocp.data[1, 0].item() == 256.0  # 1.0 -> floor(log2 1) - 8 + 127 = 119


def test_e5m2_hand_examples():
    x = torch.tensor([[1.0, -0.5, 3.0e-5, 0.0]])
    qt = quantize(x, "tensor", dtype=E5M2)
    assert qt.scale_inv.item() == float(np.float32(1 / np.float32(57344)))
    assert qt.data.float().tolist() == [[57344.0, -28672.0, 1.75, 0.0]]  # 3e-5 * 57344 = 1.72 -> 1.75
    qt = quantize(x, "row", dtype=E5M2)
    assert qt.scale_inv.item() == 2.0**-15
    assert qt.data.float().tolist() == [[32768.0, -16384.0, 1.0, 0.0]]  # 0.983 -> 1.0
    x = torch.zeros(32, 32)
    x[0, 0] = 57344.0
    x[0, 1] = 1.0
    qt = quantize(x, "mx", dtype=E5M2)
    assert qt.scale_inv.view(torch.uint8)[0, 0].item() == 127
    assert qt.data[0, :2].float().tolist() == [57344.0, 1.0]


def test_amax_epsilon():
    x = torch.tensor([[0.0, 0.0], [0.25, 0.0], [4.0, 0.0]])
    qt = quantize(x, "row", amax_epsilon=0.5)
    # amax 0 and 0.25 become 0.5 -> 896 -> 512; 4 -> 112 -> 64
    assert qt.scale_inv.flatten().tolist() == [2.0**-9, 2.0**-9, 2.0**-6]
    assert qt.data[1, 0].item() == 128.0


@pytest.mark.parametrize("granularity", ["row", "block1x128", "block128x128"])
@pytest.mark.parametrize("amax_epsilon", [0.0, 0.5])
@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_group_scales_are_amax_to_scale_of_each_group(granularity, amax_epsilon, power_2_scales, dtype):
    """The reference quantizer's scales, inline for no epsilon (issue 38) and through
    :func:`checked_amax_to_scale` for one, are :func:`amax_to_scale` of each group's amax:
    groups of zeros, of tiny and of huge values (an overflowing scale) and of an inf."""
    from fp8train.quant.kernels import use_quant_settings
    from fp8train.quant.scaling import FLOAT32_MAX, amax_to_scale

    x = _random_normal((256, 256)).to(dtype)
    x[:128, :128] = 0.0
    x[128:, :128] *= 2.0**-120
    x[:128, 128:] *= 2.0**100 if dtype == torch.bfloat16 else 2.0**20
    x[200, 200] = math.inf
    with use_quant_settings(quantize_kernel="reference"):
        qt = quantize(x, granularity, power_2_scales=power_2_scales, amax_epsilon=amax_epsilon)
    rows, cols = _group_shape(granularity, -1, 256, 256)
    amax = x.reshape(256 // rows, rows, 256 // cols, cols).abs().amax(dim=(1, 3))
    inf_scale_value = FLOAT32_MAX if granularity == "row" else torch.finfo(dtype).max
    scale = amax_to_scale(
        amax, 448.0, power_2_scales=power_2_scales, amax_epsilon=amax_epsilon, inf_scale_value=inf_scale_value
    )
    assert torch.equal(qt.scale_inv.reshape(scale.shape), torch.reciprocal(scale))
