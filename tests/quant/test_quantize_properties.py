"""quantize property tests: bit-exact against the independent numpy/ml_dtypes reference,
error bounds and use of the range (NUMERICS.md sections 2-3); the bfloat16 fast path and
the chunked scale-and-cast against the plain float32 computation."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fp8train.quant import quantize
from fp8train.spec.granularities import FP8_GRANULARITIES as GRANULARITIES

from ._quantize_reference import (
    AXES,
    BLOCK_SIZE,
    E4M3,
    E5M2,
    FLOAT32_MAX,
    FP8_FACTS,
    _codes,
    _fp8_values,
    _group_shape,
    _reference_quantize,
    _scale_inv_f64,
)


# Slack on top of half an FP8 ulp: float32 roundings of x*scale, of 1/scale and of the
# dequantize product (relative), and float32 subnormal spacing (absolute).
REL_SLACK = 2.0**-20
ABS_SLACK = 2.0**-149
# A non-power-of-two scale is float32(fp8_max / amax): amax * scale may exceed fp8_max by
# at most this relative amount.
SCALE_ROUNDING = 2.0**-23
HYPOTHESIS_EXAMPLES = 120


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
    quantize_module = importlib.import_module("fp8train.quant.fp8_quantize")

    x = (torch.randn(512, 1024, generator=torch.Generator().manual_seed(3)) * 100).to(x_dtype)
    monkeypatch.setattr(quantize_module, "CHUNK_ELEMENTS", 1 << 15)  # many chunks
    chunked = quantize(x, granularity, axis=axis)
    monkeypatch.setattr(quantize_module, "CHUNK_ELEMENTS", 1 << 40)  # one pass
    whole = quantize(x, granularity, axis=axis)
    assert torch.equal(chunked.data.view(torch.uint8), whole.data.view(torch.uint8))
    assert torch.equal(chunked.scale_inv.reshape(-1).view(torch.uint8), whole.scale_inv.reshape(-1).view(torch.uint8))
