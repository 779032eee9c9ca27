"""quantize / QuantizedTensor against NUMERICS.md sections 2-3: hand-computed examples,
edge cases, errors, and property tests against an independent numpy/ml_dtypes reference."""

from __future__ import annotations

import importlib
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fp8train import GRANULARITIES, QuantizedTensor, quantize

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")
BFLOAT16_MAX = float.fromhex("0x1.fep+127")

# Per FP8 data dtype: ml_dtypes type, largest finite, mantissa bits, smallest normal.
FP8_FACTS = {
    E4M3: (ml_dtypes.float8_e4m3fn, 448.0, 3, 2.0**-6),
    E5M2: (ml_dtypes.float8_e5m2, 57344.0, 2, 2.0**-14),
}
BLOCK_SIZE = {"block1x128": 128, "block128x128": 128, "mx": 32}
AXES = (-1, 0)
ALL_CASES = [(g, a) for g in GRANULARITIES for a in AXES]

# Slack on top of half an FP8 ulp: float32 roundings of x*scale, of 1/scale and of the
# dequantize product (relative), and float32 subnormal spacing (absolute).
REL_SLACK = 2.0**-20
ABS_SLACK = 2.0**-149
# A non-power-of-two scale is float32(fp8_max / amax): amax * scale may exceed fp8_max by
# at most this relative amount.
SCALE_ROUNDING = 2.0**-23
HYPOTHESIS_EXAMPLES = 120


def _group_shape(granularity: str, axis: int, m: int, k: int) -> tuple[int, int]:
    """``(rows, cols)`` of one scaling group: the table in NUMERICS.md / quantize.py."""
    if granularity == "tensor":
        return m, k
    if granularity == "row":
        return (1, k) if axis == -1 else (m, 1)
    if granularity == "block128x128":
        return 128, 128
    block = BLOCK_SIZE[granularity]
    return (1, block) if axis == -1 else (block, 1)


def _scale_inv_shape(granularity: str, axis: int, m: int, k: int) -> tuple[int, ...]:
    if granularity == "tensor":
        return ()
    rows, cols = _group_shape(granularity, axis, m, k)
    return (m // rows if rows else 1, k // cols if cols else 1)


def _oracle_cast(x_f32: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Saturating RNE cast by ml_dtypes, as uint8 codes."""
    ml_type, fp8_max, _, _ = FP8_FACTS[dtype]
    with np.errstate(invalid="ignore"):
        return np.clip(x_f32, -fp8_max, fp8_max).astype(ml_type).view(np.uint8)


def _fp8_values(codes: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return codes.view(FP8_FACTS[dtype][0]).astype(np.float64)


def _decode_e8m0(codes: np.ndarray) -> np.ndarray:
    values = np.ldexp(1.0, codes.astype(np.int64) - 127)
    return np.where(codes == 0xFF, np.nan, values)


def _reference_mx_exponent(amax: np.ndarray, fp8_max: float, rule: str) -> np.ndarray:
    """Biased E8M0 exponent per block, from the closed forms in NUMERICS.md."""
    reciprocal = float(np.float32(1.0 / fp8_max))  # the spec multiplies by float32(1/448)
    emax = math.frexp(fp8_max)[1] - 1
    out = np.zeros(amax.shape, dtype=np.int64)
    for index, a in np.ndenumerate(amax.astype(np.float64)):
        if math.isnan(a):
            e = 0xFF
        elif math.isinf(a):
            e = 0xFE
        elif a == 0:
            e = 0
        elif rule == "ceil":
            # smallest j with a <= fp8_max * 2^j (exact comparisons in float64)
            j = math.ceil(math.log2(a / fp8_max))
            while a > fp8_max * 2.0**j:
                j += 1
            while a <= fp8_max * 2.0 ** (j - 1):
                j -= 1
            e = j + 127
            if e < 1:
                # t is a float32 subnormal, which rounds up to exponent 1 unless t rounds
                # to 0 (a * reciprocal is exact in float64: 24 x 24 bits)
                e = 1 if a * reciprocal > 2.0**-150 else 0
        else:
            e = min(max(math.frexp(a)[1] - 1 - emax + 127, 0), 254)
        out[index] = e
    return out


def _reference_quantize(
    x_hp: torch.Tensor,
    granularity: str,
    axis: int,
    dtype: torch.dtype,
    power_2_scales: bool,
    mx_scale_rule: str = "ceil",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Data codes ``(M, K)``, compact scale_inv (float32, or uint8 E8M0 codes) and the float32
    scale per group (shaped ``(M/rows, 1, K/cols, 1)``), in numpy."""
    _, fp8_max, _, _ = FP8_FACTS[dtype]
    x = x_hp.to(torch.float32).numpy()  # exact from bf16/fp16
    m, k = (math.prod(x.shape[:-1]), x.shape[-1])
    rows, cols = _group_shape(granularity, axis, m, k)
    groups = x.reshape(m // rows, rows, k // cols, cols)
    amax = np.abs(groups).max(axis=(1, 3), keepdims=True)
    if granularity == "mx":
        exponent = _reference_mx_exponent(amax, fp8_max, mx_scale_rule)
        scale = np.ldexp(1.0, 127 - exponent).astype(np.float32)
        scale = np.where(exponent == 0xFF, np.float32(np.nan), scale)
        scale_inv = exponent.astype(np.uint8)
    else:
        inf_scale_value = torch.finfo(x_hp.dtype).max if granularity in BLOCK_SIZE else FLOAT32_MAX
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            scale = np.float32(fp8_max) / amax
        scale = np.where(np.isinf(scale), np.float32(inf_scale_value), scale)
        scale = np.where((amax == 0) | ~np.isfinite(amax), np.float32(1), scale).astype(np.float32)
        if power_2_scales:
            scale = np.ldexp(1.0, np.frexp(scale)[1] - 1).astype(np.float32)
        scale_inv = (np.float32(1) / scale).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        data = _oracle_cast((groups * scale).astype(np.float32), dtype).reshape(m, k)
    return data, scale_inv.reshape(scale_inv.shape[0], scale_inv.shape[2]), scale


def _codes(qt: QuantizedTensor) -> np.ndarray:
    return qt.data.reshape(-1, qt.data.shape[-1] if qt.data.dim() else 1).view(torch.uint8).numpy()


def _assert_data_equal(actual_codes: np.ndarray, expected_codes: np.ndarray, dtype: torch.dtype) -> None:
    # NaN codes differ between torch and ml_dtypes: NaN positions only need to be NaN.
    actual_nan = np.isnan(_fp8_values(actual_codes, dtype))
    expected_nan = np.isnan(_fp8_values(expected_codes, dtype))
    np.testing.assert_array_equal(actual_nan, expected_nan)
    np.testing.assert_array_equal(actual_codes[~expected_nan], expected_codes[~expected_nan])


def _bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor of any rank (0-d included), for bit-exact comparisons."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _scale_inv_f64(qt: QuantizedTensor) -> np.ndarray:
    if qt.granularity == "mx":
        return _decode_e8m0(qt.scale_inv.view(torch.uint8).numpy())
    return qt.scale_inv.numpy().astype(np.float64)


def _random_normal(shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


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


# ---------------------------------------------------------------- property tests


def _fp8_ulp(magnitude: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Spacing of the FP8 format at ``magnitude`` (float64): constant in the subnormal range."""
    _, _, mantissa_bits, smallest_normal = FP8_FACTS[dtype]
    exponent = np.frexp(np.maximum(magnitude, smallest_normal))[1] - 1
    return np.ldexp(1.0, exponent - mantissa_bits)


# log2-magnitude range of the generated values, per input dtype (kept inside its range).
EXPONENT_RANGE = {torch.float32: (-140, 126), torch.bfloat16: (-130, 126), torch.float16: (-26, 14)}


def _draw_settings(draw) -> tuple[str, int, torch.dtype, int, int, bool, str]:
    granularity = draw(st.sampled_from(GRANULARITIES))
    axis = draw(st.sampled_from(AXES))
    dtype = draw(st.sampled_from([E4M3, E5M2]))
    block = BLOCK_SIZE.get(granularity)
    if block:
        m = block * draw(st.integers(1, 3 if block == 32 else 2))
        k = block * draw(st.integers(1, 3 if block == 32 else 2))
    else:
        m, k = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    power_2_scales = True if granularity == "mx" else draw(st.booleans())
    mx_scale_rule = draw(st.sampled_from(["ceil", "ocp"])) if granularity == "mx" else "ceil"
    return granularity, axis, dtype, m, k, power_2_scales, mx_scale_rule


@st.composite
def quantize_cases(draw):
    """Values spread over a drawn exponent range, group by group."""
    granularity, axis, dtype, m, k, power_2_scales, mx_scale_rule = _draw_settings(draw)
    x_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    low, high = EXPONENT_RANGE[x_dtype]
    center = draw(st.integers(low, high))
    spread = draw(st.integers(0, 40))
    zero_fraction = draw(st.sampled_from([0.0, 0.2, 0.9]))
    seed = draw(st.integers(0, 2**32 - 1))

    rng = np.random.default_rng(seed)
    # Per-row offsets make groups of very different magnitude; per-value jitter widens each.
    exponent = center + rng.integers(-spread, spread + 1, size=(m, 1)) + rng.uniform(-spread, spread, size=(m, k))
    exponent = np.clip(np.floor(exponent), low, high)
    values = np.ldexp(rng.uniform(1.0, 2.0, size=(m, k)), exponent.astype(np.int64))
    values *= rng.choice([-1.0, 1.0], size=(m, k))
    values[rng.uniform(size=(m, k)) < zero_fraction] = 0.0
    x = torch.from_numpy(values.astype(np.float32)).to(x_dtype)
    return x, granularity, axis, dtype, power_2_scales, mx_scale_rule


@st.composite
def quantize_cases_from_floats(draw):
    """A few dozen values drawn by hypothesis (so it can pick and shrink to subnormals,
    float32 max and the like), optionally rounded to bfloat16, tiled over the tensor."""
    granularity, axis, dtype, m, k, power_2_scales, mx_scale_rule = _draw_settings(draw)
    finite_float32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
    values = draw(st.lists(finite_float32, min_size=1, max_size=64))
    seed = draw(st.integers(0, 2**32 - 1))
    tiled = np.resize(np.array(values, dtype=np.float32), m * k)
    x = torch.from_numpy(np.random.default_rng(seed).permutation(tiled).reshape(m, k))
    if draw(st.booleans()):
        x = x.to(torch.bfloat16)
        assume(torch.isfinite(x).all())  # values near float32 max round up to inf
    return x, granularity, axis, dtype, power_2_scales, mx_scale_rule


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(case=quantize_cases())
def test_property_quantize_matches_reference_and_error_bounds(case):
    _check_quantize_properties(*case)


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(case=quantize_cases_from_floats())
def test_property_quantize_of_drawn_floats(case):
    _check_quantize_properties(*case)


def _check_quantize_properties(
    x: torch.Tensor, granularity: str, axis: int, dtype: torch.dtype, power_2_scales: bool, mx_scale_rule: str
) -> None:
    _, fp8_max, _, _ = FP8_FACTS[dtype]
    qt = quantize(x, granularity, dtype=dtype, axis=axis, power_2_scales=power_2_scales, mx_scale_rule=mx_scale_rule)
    m, k = x.shape
    rows, cols = _group_shape(granularity, axis, m, k)

    # 1. bit-exact against the numpy/ml_dtypes reference
    data_ref, scale_inv_ref, scale_ref = _reference_quantize(
        x, granularity, axis, dtype, power_2_scales, mx_scale_rule
    )
    codes = _codes(qt)
    np.testing.assert_array_equal(codes, data_ref)
    scale_inv_bytes = qt.scale_inv.reshape(scale_inv_ref.shape).view(torch.uint8).numpy()
    np.testing.assert_array_equal(scale_inv_bytes, scale_inv_ref.view(np.uint8))

    # 2. dequantize is data * scale_inv, in float32
    data = _fp8_values(codes, dtype)
    scale_inv = _scale_inv_f64(qt).reshape(m // rows, 1, k // cols, 1)
    with np.errstate(over="ignore"):
        expected_dequantized = (data.reshape(m // rows, rows, k // cols, cols) * scale_inv).astype(np.float32)
    np.testing.assert_array_equal(qt.dequantize().numpy(), expected_dequantized.reshape(m, k))

    # 3. every value that does not saturate is within half an FP8 ulp (times scale_inv)
    x64 = x.to(torch.float64).numpy().reshape(m // rows, rows, k // cols, cols)
    # The float32 scale itself: 1 / scale_inv can be far off when scale_inv is a float32
    # subnormal (tiny amax, non-power-of-two scale).
    scale = scale_ref.astype(np.float64)
    scaled = np.abs(x64) * scale
    error = np.abs(expected_dequantized.astype(np.float64) - x64)
    bound = 0.5 * _fp8_ulp(scaled, dtype) * scale_inv + REL_SLACK * np.abs(x64) + ABS_SLACK
    # A value within half an FP8 ulp of float32 max may round up to 2^128, which float32
    # dequantize cannot hold (e.g. 3.2965e38 -> 256 * 2^120): only finite results are bounded.
    in_range = (scaled <= fp8_max) & np.isfinite(expected_dequantized)
    assert (error <= bound)[in_range].all(), f"max excess {(error - bound)[in_range].max()}"

    # 4. nothing saturates that should not, and the scale uses the range
    amax = np.abs(x64).max(axis=(1, 3), keepdims=True)
    top = (amax * scale)[amax > 0]
    if granularity == "mx" and mx_scale_rule == "ocp":
        return  # the OCP rule may saturate by design
    assert (scaled <= fp8_max * (1 + SCALE_ROUNDING)).all()
    if granularity == "mx":
        normal_t = (amax > 0) & (amax >= fp8_max * 2.0**-126)
        assert ((amax * scale)[normal_t] > fp8_max / 2).all()
    elif power_2_scales:
        replaced = top < fp8_max / 2
        # only where fp8_max / amax overflowed and was replaced by a finite value
        assert (amax[amax > 0][replaced] < fp8_max / FLOAT32_MAX * 2).all()
    else:
        group_max = np.abs(data.reshape(m // rows, rows, k // cols, cols)).max(axis=(1, 3), keepdims=True)
        not_replaced = (amax > 0) & (amax * np.float64(FLOAT32_MAX) > fp8_max)
        assert (group_max[not_replaced] == fp8_max).all()


# ---------------------------------------------------------------------------
# bfloat16 inputs with power-of-two scales are multiplied in bfloat16 (a faster path):
# the FP8 codes must equal the float32 computation's on every exponent.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["row", "block1x128", "block128x128", "mx"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("axis", [-1, 0])
def test_bf16_power_of_2_path_matches_float32_codes(granularity, dtype, axis):
    generator = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**15), 2**15, (1024, 256), generator=generator, dtype=torch.int32)
    x = bits.to(torch.int16).view(torch.bfloat16)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # every finite exponent
    fast = quantize(x, granularity, dtype=dtype, axis=axis)
    reference = quantize(x.float(), granularity, dtype=dtype, axis=axis)
    assert fast.power_2_scales
    assert torch.equal(fast.data.view(torch.uint8), reference.data.view(torch.uint8))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunked_scale_and_cast_equals_one_pass(granularity, axis, x_dtype, monkeypatch):
    """Large CPU tensors are scaled and cast in chunks: the codes must not change."""
    quantize_module = importlib.import_module("fp8train.quantize")  # (the package exports the function)

    x = (torch.randn(512, 1024, generator=torch.Generator().manual_seed(3)) * 100).to(x_dtype)
    monkeypatch.setattr(quantize_module, "_CHUNK_ELEMENTS", 1 << 15)  # many chunks
    chunked = quantize(x, granularity, axis=axis)
    monkeypatch.setattr(quantize_module, "_CHUNK_ELEMENTS", 1 << 40)  # one pass
    whole = quantize(x, granularity, axis=axis)
    assert torch.equal(chunked.data.view(torch.uint8), whole.data.view(torch.uint8))
    assert torch.equal(chunked.scale_inv.reshape(-1).view(torch.uint8), whole.scale_inv.reshape(-1).view(torch.uint8))
