"""4-bit quantization in JAX (NVFP4, NVFP4 16x16, MXFP4, the Hadamard transform) equals
``fp8train.quant.quantize(..., dtype=torch.float4_e2m1fn_x2)`` bit for bit: packed codes, block
scales and NVFP4's global amax, on inputs of every class, each input dtype, both axes, with
and without the transform. The E2M1 cast against a hand table; the IEEE helpers that keep
subnormals against NumPy; stochastic rounding by its statistics (its bits come from a JAX
key, not PyTorch's generator)."""

from __future__ import annotations

import functools

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fp8train  # noqa: E402
import fp8train.jax as fj  # noqa: E402
from fp8train.jax.e2m1 import cast_to_e2m1, e2m1_to_float32, pack_e2m1, unpack_e2m1  # noqa: E402
from fp8train.jax.hadamard import random_hadamard_transform  # noqa: E402
from fp8train.jax.ieee import exact_add, exact_divide, exact_multiply, exact_reciprocal  # noqa: E402
from fp8train.jax.quantize import quantize as jax_quantize_by_rule  # noqa: E402
from fp8train.quant.hadamard import random_hadamard_transform as torch_rht  # noqa: E402
from fp8train.spec import QuantRule  # noqa: E402

from ._common import every_class, to_jax, to_torch  # noqa: E402

SHAPE = (64, 128)  # one shape for every case: one compile per (case, dtype)
MIXED = ("normal", "zeros", "subnormal", "tiny", "mx_threshold")
"""Classes that share one tensor under NVFP4 (a NaN or an inf anywhere decides every scale)."""
INPUTS = {"mixed": MIXED, "tiny": ("subnormal", "tiny", "zeros"), "huge": ("huge", "subnormal", "normal"), "nan": ("nan",), "inf": ("inf",)}
"""Tensors of several classes: ``tiny`` makes NVFP4's ``gd`` a float32 subnormal."""

# (granularity, axis, rht): a few by default (JAX compiles each; 16x16 tiles are also in
# test_dequantize_and_transpose and the GEMM tests), every dtype and case under -m slow.
CASES = [("nvfp4", -1, True), ("mxfp4", 0, False)]
DEFAULT_16BIT: list = []  # 16-bit inputs: test_linear's bfloat16 cases by default, every class here under -m slow
SLOW = [
    (dtype, g, axis, rht)
    for dtype in ("float32", "bfloat16", "float16")
    for g, axis, rht in [("nvfp4", -1, False), ("nvfp4", 0, True), ("nvfp4", -1, True), ("nvfp4", 0, False), ("nvfp4_2d", -1, False), ("mxfp4", -1, False), ("mxfp4", 0, False)]
    if (dtype, g, axis, rht) not in DEFAULT_16BIT and (dtype != "float32" or (g, axis, rht) not in CASES)
]


@functools.cache
def _jitted(granularity, axis, rht):
    return jax.jit(lambda x: fj.quantize(x, granularity, axis=axis, rht=rht))


def _e4m3_nan_as_one(codes: np.ndarray) -> np.ndarray:
    """E4M3 codes with both NaNs (0x7F, 0xFF) as 0x7F: an E4M3 NaN's sign is unspecified."""
    return np.where(codes & 0x7F == 0x7F, 0x7F, codes)


def assert_same_fp4(qa, qt) -> None:
    """Packed codes, scales and global amax bit for bit (a NaN scale's sign aside)."""
    np.testing.assert_array_equal(np.asarray(qa.data), qt.data.view(torch.uint8).numpy())
    j_scales, t_scales = np.asarray(qa.scale_inv).view(np.uint8), qt.scale_inv.view(torch.uint8).numpy()
    if not qa.granularity.e8m0_scales:
        j_scales, t_scales = _e4m3_nan_as_one(j_scales), _e4m3_nan_as_one(t_scales)
    np.testing.assert_array_equal(j_scales, t_scales)
    assert (qa.global_amax is None) == (qt.global_amax is None)
    if qt.global_amax is not None:
        j_amax, t_amax = np.asarray(qa.global_amax, np.float32), qt.global_amax.numpy()
        assert (np.isnan(j_amax) and np.isnan(t_amax)) or j_amax.view(np.uint32) == t_amax.view(np.uint32)
    assert (qa.axis, str(qa.granularity), qa.power_2_scales) == (qt.axis, str(qt.granularity), qt.power_2_scales)


def _check_every_input(dtype, granularity, axis, rht):
    for name, classes in INPUTS.items():
        x = every_class(dtype, granularity, axis, SHAPE, seed=len(name), classes=classes)
        qa = _jitted(granularity, axis, rht)(to_jax(x, dtype))
        qt = fp8train.quant.quantize(to_torch(x, dtype), granularity, dtype=torch.float4_e2m1fn_x2, axis=axis, rht=rht)
        assert_same_fp4(qa, qt)


@pytest.mark.parametrize("granularity, axis, rht", CASES)
def test_matches_pytorch_float32_every_class(granularity, axis, rht):
    _check_every_input("float32", granularity, axis, rht)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, granularity, axis, rht", SLOW)
def test_matches_pytorch_every_class_rest(dtype, granularity, axis, rht):
    _check_every_input(dtype, granularity, axis, rht)


def test_transform_matches_pytorch_on_subnormals_and_ties():
    """The transform alone, float32 and bfloat16, on runs of subnormals (their products and
    sums, which XLA's CPU would flush) and of normal values; both axes."""
    rng = np.random.default_rng(5)
    tiny = rng.integers(-(2**23), 2**23, (32, 64)).astype(np.float32) * np.float32(2.0**-149)
    x = np.concatenate([tiny, rng.standard_normal((32, 64)).astype(np.float32)])
    transform = jax.jit(random_hadamard_transform, static_argnums=1)
    for dtype in ("float32", "bfloat16"):
        for axis in (-1, 0):
            got = np.asarray(transform(to_jax(x, dtype), axis).astype(jnp.float32))
            expected = torch_rht(to_torch(x, dtype), axis).float().numpy()
            np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_e2m1_cast_ties_signs_and_nan():
    """Round to nearest even at every midpoint, saturation, the sign of values that round
    to zero (negative subnormals too), ``-0.0`` and NaN to code 0; the values of all 16
    codes; packing the even index into the low nibble, both axes."""
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2500001, 7.0, np.inf, -0.1, -1e-40, -0.0, np.nan, -6.0, 2.75], np.float32)
    expected = [0, 2, 2, 4, 4, 6, 6, 1, 7, 7, 8, 8, 0, 0, 15, 5]
    codes = np.arange(16, dtype=np.uint8).reshape(2, 8)

    @jax.jit
    def run(v, codes):
        round_trips = [unpack_e2m1(pack_e2m1(codes, axis), axis) for axis in (-1, 0)]
        return cast_to_e2m1(v), e2m1_to_float32(codes.reshape(-1)), pack_e2m1(codes, -1), round_trips

    got_codes, values, packed, round_trips = jax.tree.map(np.asarray, run(jnp.asarray(v), jnp.asarray(codes)))
    np.testing.assert_array_equal(got_codes, expected)
    np.testing.assert_array_equal(np.abs(values), [0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2)
    assert np.signbit(values[8:]).all() and not np.signbit(values[:8]).any()
    np.testing.assert_array_equal(packed[0], [0x10, 0x32, 0x54, 0x76])
    for round_trip in round_trips:
        np.testing.assert_array_equal(round_trip, codes)


def test_ieee_helpers_keep_subnormals_as_numpy_does():
    """Products, sums, reciprocals and the division by 7225344 of float32 values across the
    whole range (subnormal operands and results, ties on the subnormal grid, infinities,
    NaN, zeros) equal NumPy's IEEE float32 bit for bit."""
    rng = np.random.default_rng(6)
    n = 20000
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    small = (rng.standard_normal(n) * np.exp2(rng.integers(-140, -40, n))).astype(np.float32)
    ties = (rng.integers(1, 64, n) * 2 + 1).astype(np.float32) * np.float32(2.0**-150) * 2  # odd multiples of 2^-149
    a = np.where(rng.integers(0, 3, n) == 0, bits, np.where(rng.integers(0, 2, n) == 0, small, ties)).astype(np.float32)
    b = np.where(rng.integers(0, 2, n) == 0, bits[::-1], np.float32(0.5)).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45], np.float32)
    a, b = np.concatenate([a, specials, specials]), np.concatenate([b, specials, specials[::-1]])
    with np.errstate(all="ignore"):
        expected = {"mul": a * b, "add": a + b, "recip": np.float32(1) / a, "div": a / np.float32(7225344.0)}
    got = jax.jit(lambda a, b: {"mul": exact_multiply(a, b), "add": exact_add(a, b), "recip": exact_reciprocal(a), "div": exact_divide(a, 7225344.0)})(a, b)
    for name, e in expected.items():
        g = np.asarray(got[name])
        same = (g.view(np.uint32) == e.view(np.uint32)) | (np.isnan(g) & np.isnan(e))
        assert same.all(), f"{name}: {np.flatnonzero(~same)[:5]}"


def _sr_rule(granularity="mxfp4"):
    return QuantRule(granularity=granularity, stochastic_rounding=True)


_SR = jax.jit(lambda x, key: jax_quantize_by_rule(x, _sr_rule(), axis=-1, key=key))
_SR_NVFP4 = jax.jit(lambda x, key: jax_quantize_by_rule(x, _sr_rule("nvfp4"), axis=-1, key=key))
_DEQUANTIZE = jax.jit(fj.QuantizedArray.dequantize)


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    """MXFP4 (one power-of-two scale: each block's largest value 6 maps to 6): values
    between two E2M1 neighbours become one of the two, the lower with probability
    ``(hi - v) / (hi - lo)``: the mean of ~8000 roundings is within 5 standard errors of
    ``v``; representable values never move; the same key gives the same codes, another
    key other codes; and the codes are the documented map of ``jax.random.uniform``."""
    targets = np.array([0.1, 0.3, 1.2, 1.75, 2.3, 2.9, 3.5, 4.1, 5.5, -0.7, -2.6, -5.9, 0.01, -0.2, 4.9, -1.1], np.float32)
    x = np.repeat(np.tile(targets, 2)[:, None], 4096, axis=1)
    x[:, ::32] = 6.0  # every block's scale is 1
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
    qa = _SR(jnp.asarray(x), jax.random.key(0))
    # The documented map, on magnitudes: away from zero where
    # jax.random.uniform(key, (M, K)) < (|v| - lo) / (hi - lo).
    draws = np.asarray(jax.random.uniform(jax.random.key(0), x.shape, jnp.float32))
    magnitudes = np.abs(x)
    steps = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    below = np.searchsorted(steps, magnitudes, side="right") - 1
    lows = steps[below]
    highs = steps[np.minimum(below + (magnitudes > lows), 7)]
    gaps = np.where(highs > lows, highs - lows, 1).astype(np.float32)
    mapped = np.copysign(np.where(draws < (magnitudes - lows) / gaps, highs, lows), x)
    np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(qa)), mapped)
    values = mapped.reshape(2, len(targets), 4096)
    for i, target in enumerate(targets):
        row = np.delete(values[:, i], np.s_[::32], axis=1).reshape(-1)
        lo, hi = grid[grid <= target].max(), grid[grid >= target].min()
        assert set(np.unique(row)) <= {lo, hi}, (target, np.unique(row))
        p = (target - lo) / (hi - lo)
        stderr = (hi - lo) * np.sqrt(p * (1 - p) / row.size)
        assert abs(row.mean() - target) < 5 * stderr, (target, row.mean())
    exact = np.tile(grid, (32, 3))[:, :32].copy()
    exact[:, 0] = 6.0
    np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(_SR(jnp.asarray(exact), jax.random.key(1)))), exact)
    again = _SR(jnp.asarray(x), jax.random.key(0))
    other = _SR(jnp.asarray(x), jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(again.data), np.asarray(qa.data))
    assert (np.asarray(other.data) != np.asarray(qa.data)).mean() > 0.1


def test_nvfp4_stochastic_rounding_keeps_the_scales_and_moves_codes_one_step():
    """NVFP4 with stochastic rounding: scales and global amax as round-to-nearest (PyTorch's,
    bit for bit); every code the nearest one or its neighbour on the same side of zero."""
    x = np.random.default_rng(7).standard_normal(SHAPE).astype(np.float32)
    qa = _SR_NVFP4(jnp.asarray(x), jax.random.key(2))
    qt = fp8train.quant.quantize(torch.from_numpy(x), "nvfp4", dtype=torch.float4_e2m1fn_x2)
    np.testing.assert_array_equal(np.asarray(qa.scale_inv).view(np.uint8), qt.scale_inv.view(torch.uint8).numpy())
    assert np.asarray(qa.global_amax) == qt.global_amax.numpy()
    sr, rne = np.asarray(unpack_e2m1(qa.data, -1)).astype(int), qt.values_float32().numpy()
    rne_codes = np.asarray(jax.jit(cast_to_e2m1)(jnp.asarray(rne))).astype(int)
    assert (np.abs((sr & 7) - (rne_codes & 7)) <= 1).all() and ((sr & 8) == (rne_codes & 8))[rne != 0].all()
    assert 0 < (sr != rne_codes).mean() < 0.6


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: fj.quantize(jnp.ones((32, 32)), "nvfp4", stochastic_rounding=True), ValueError,
         r"stochastic_rounding=True draws from a JAX PRNG key: pass key=jax.random.key\(seed\)"),
        (lambda: fj.quantize(jnp.ones((64, 64)), "mxfp4", rht=True), ValueError, "rht=True is not possible for 'mxfp4'"),
        (lambda: fj.quantize(jnp.ones((32, 32)), "nvfp4", dtype=jnp.float8_e4m3fn), ValueError, "granularity 'nvfp4' takes 4-bit E2M1 data"),
        (lambda: fj.quantize(jnp.ones((32, 32)), "row", dtype=jnp.float4_e2m1fn), ValueError, "format=E2M1 needs a 4-bit granularity"),
        (lambda: fj.quantize(jnp.ones((32, 24)), "nvfp4"), ValueError, r"divisible by 16; shape \(32, 24\)"),
        (lambda: fj.quantize(jnp.ones((32, 32)), "nvfp4", power_2_scales=True), ValueError, "power_2_scales=True is not possible for 'nvfp4'"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_dequantize_and_transpose_of_4bit_arrays():
    """``dequantize`` and the 16x16 transpose (unpacked and packed again along the new last
    dim) agree with PyTorch's."""
    from fp8train.quant.tensor import transpose as torch_transpose

    x = np.random.default_rng(8).standard_normal((32, 64)).astype(np.float32)
    for granularity, axis in (("nvfp4_2d", -1), ("mxfp4", 0)):
        qa = _jitted(granularity, axis, False)(jnp.asarray(x))
        qt = fp8train.quant.quantize(torch.from_numpy(x), granularity, axis=axis)
        np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(qa)), qt.dequantize().numpy())
        assert_same_fp4(jax.jit(fj.transpose)(qa), torch_transpose(qt))
