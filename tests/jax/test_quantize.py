"""``fp8train.jax.quantize`` equals ``fp8train.quant.quantize`` bit for bit (codes and scales), for
every granularity, axis, format and input dtype, on inputs of every class; the cast and
the E8M0 decode against ``ml_dtypes``; errors name the value and the fix."""

from __future__ import annotations

import itertools

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fp8train  # noqa: E402
import fp8train.jax as fj  # noqa: E402
from fp8train.spec.granularities import FP8_GRANULARITIES as GRANULARITIES  # noqa: E402  (4-bit: test_fp4.py)

from ._common import (  # noqa: E402
    CLASSES,
    FP8_MAX,
    JAX_FP8,
    TORCH_FP8,
    every_class,
    fp8_codes_equal,
    mx_threshold_amaxes,
    scales_equal,
    to_jax,
    to_torch,
)

CASES = list(itertools.product(GRANULARITIES, (-1, 0), ("e4m3", "e5m2")))
# float32 runs every case; bfloat16 and float16 one case per granularity (axes and formats
# alternating) by default, every case under -m slow.
DEFAULT_16BIT = [
    ("bfloat16", "row", 0, "e4m3"),
    ("bfloat16", "block1x128", -1, "e5m2"),
    ("float16", "tensor", -1, "e5m2"),
    ("float16", "mx", 0, "e4m3"),
]
SLOW_16BIT = [(d, *case) for d in ("bfloat16", "float16") for case in CASES if (d, *case) not in DEFAULT_16BIT]




def _quantize(x, granularity, axis, fp8, **kwargs):
    """``fj.quantize`` under ``jax.jit`` (static arguments: one trace per case)."""
    return _jitted(granularity, axis, fp8, tuple(sorted(kwargs.items())))(x)


_CACHE = {}


def _jitted(granularity, axis, fp8, options):
    key = (granularity, axis, fp8, options)
    if key not in _CACHE:
        _CACHE[key] = jax.jit(lambda x: fj.quantize(x, granularity, dtype=JAX_FP8[fp8], axis=axis, **dict(options)))
    return _CACHE[key]


def _check_every_class(dtype, granularity, axis, fp8, **kwargs):
    """Every class in some group; ``tensor`` (one group) once per class."""
    seeds = range(len(CLASSES)) if granularity == "tensor" else (0,)
    for seed in seeds:
        _check_same(every_class(dtype, granularity, axis, seed=seed), dtype, granularity, axis, fp8, **kwargs)


def _check_same(x_np, dtype, granularity, axis, fp8, **kwargs):
    qa = _quantize(to_jax(x_np, dtype), granularity, axis, fp8, **kwargs)
    qt = fp8train.quant.quantize(to_torch(x_np, dtype), granularity, dtype=TORCH_FP8[fp8], axis=axis, **kwargs)
    fp8_codes_equal(qa.data, qt.data)
    scales_equal(qa.scale_inv, qt.scale_inv)
    assert qa.axis == qt.axis and qa.power_2_scales == qt.power_2_scales and str(qa.granularity) == str(qt.granularity)


@pytest.mark.parametrize("granularity, axis, fp8", CASES)
def test_matches_pytorch_float32_every_class(granularity, axis, fp8):
    _check_every_class("float32", granularity, axis, fp8)


@pytest.mark.parametrize("dtype, granularity, axis, fp8", DEFAULT_16BIT)
def test_matches_pytorch_16bit_every_class(granularity, axis, fp8, dtype):
    _check_every_class(dtype, granularity, axis, fp8)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, granularity, axis, fp8", SLOW_16BIT)
def test_matches_pytorch_16bit_every_class_rest(granularity, axis, fp8, dtype):
    _check_every_class(dtype, granularity, axis, fp8)


@pytest.mark.parametrize(
    "granularity, axis, options",
    [
        ("block1x128", 0, {"power_2_scales": False}),
        ("block128x128", -1, {"power_2_scales": False}),
        ("row", -1, {"power_2_scales": False, "amax_epsilon": 1e-3}),
        ("tensor", -1, {"power_2_scales": True, "amax_epsilon": 2.0**-100}),
        ("mx", 0, {"mx_scale_rule": "ocp", "amax_epsilon": 1e-30}),
    ],
)
def test_matches_pytorch_with_options(granularity, axis, options):
    _check_every_class("float32", granularity, axis, "e4m3", **options)


def test_matches_pytorch_on_rank_3_and_odd_shapes():
    rng = np.random.default_rng(2)
    for granularity, shape in [("mx", (2, 64, 96)), ("block1x128", (2, 64, 256)), ("row", (3, 5, 7)), ("tensor", (7,))]:
        x = rng.standard_normal(shape).astype(np.float32)
        _check_same(x, "float32", granularity, -1 if len(shape) == 1 or granularity == "row" else 0, "e5m2")


def test_precomputed_scale_matches_pytorch_and_saturates():
    """Delayed scaling's path: a given scale, values far beyond the format, exact ties."""
    x = every_class("float32", "row", -1, seed=3)
    jitted = {
        fp8: jax.jit(lambda v, s, fp8=fp8: fj.quantize(v, "tensor", dtype=JAX_FP8[fp8], scale=s)) for fp8 in JAX_FP8
    }
    for fp8, scale in itertools.product(("e4m3", "e5m2"), (1.0, 3.0e4, 2.0**-130 * 3, 2.0**127)):
        qa = jitted[fp8](jnp.asarray(x), jnp.float32(scale))
        qt = fp8train.quant.quantize(torch.from_numpy(x), "tensor", dtype=TORCH_FP8[fp8], scale=torch.tensor(scale))
        fp8_codes_equal(qa.data, qt.data)
        scales_equal(qa.scale_inv, qt.scale_inv)
    saturated = np.asarray(jitted["e4m3"](jnp.asarray(x), jnp.float32(3.0e4)).data).astype(np.float32)
    assert np.nanmax(np.abs(saturated)) == FP8_MAX["e4m3"]


def test_empty_input_gives_unit_scales():
    qa = _quantize(jnp.zeros((0, 64)), "mx", -1, "e4m3")
    qt = fp8train.quant.quantize(torch.zeros(0, 64), "mx", axis=-1)
    assert qa.data.shape == (0, 64) and qa.scale_inv.shape == tuple(qt.scale_inv.shape)
    qa = _quantize(jnp.zeros((0, 16)), "tensor", -1, "e4m3")
    assert float(qa.scale_inv) == 1.0


def test_cast_matches_ml_dtypes_on_every_code_tie_and_overflow():
    """Every FP8 code, the midpoints between neighbours (ties) and one float32 ulp either
    side, values beyond the largest finite one, infinities and NaN."""
    for fp8 in ("e4m3", "e5m2"):
        ml_type = getattr(ml_dtypes, jnp.dtype(JAX_FP8[fp8]).name)
        codes = np.arange(256, dtype=np.uint8).view(ml_type).astype(np.float32)
        finite = np.unique(codes[np.isfinite(codes)])
        midpoints = (finite[:-1].astype(np.float64) + finite[1:]) / 2
        mids = midpoints.astype(np.float32)
        values = np.concatenate(
            [finite, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
             np.array([1e6, -1e6, np.inf, -np.inf, np.nan, 3.0e38, FP8_MAX[fp8] * 1.0625], np.float32)]
        )
        got = np.asarray(jax.jit(lambda v: fj.cast_to_fp8(v, JAX_FP8[fp8]))(jnp.asarray(values)))
        fp8_max = FP8_MAX[fp8]
        expected = np.clip(values, -fp8_max, fp8_max).astype(ml_type)
        nan = np.isnan(values)
        np.testing.assert_array_equal(got.view(np.uint8)[~nan], expected.view(np.uint8)[~nan])
        assert np.isnan(got[nan].astype(np.float32)).all()


def test_e8m0_scales_decode_like_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    qa = fj.QuantizedArray(
        data=jnp.zeros((32, 256 * 32), jnp.float8_e4m3fn),
        scale_inv=jnp.asarray(np.tile(codes, (32, 1)).view(ml_dtypes.float8_e8m0fnu)),
        granularity="mx",
    )
    decoded = np.asarray(qa.scale_inv_float32())[0]
    expected = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(decoded), np.isnan(expected))
    np.testing.assert_array_equal(decoded[:255].view(np.uint32), expected[:255].view(np.uint32))


def test_mx_exponent_matches_pytorch_around_the_subnormal_thresholds():
    """The amaxes where XLA (flushing subnormals) and IEEE arithmetic part ways."""
    from fp8train.jax.scaling import mx_scale_exponent as jax_rule
    from fp8train.quant.scaling import mx_scale_exponent as torch_rule

    amaxes = np.concatenate([mx_threshold_amaxes(), np.array([0, 1e-45, 1e-40, 2.0**-126, 1, np.inf, np.nan], np.float32)])
    for fp8_max, rule in itertools.product(FP8_MAX.values(), ("ceil", "ocp")):
        got = np.asarray(jax.jit(jax_rule, static_argnums=(1, 2))(jnp.asarray(amaxes), fp8_max, rule))
        expected = torch_rule(torch.from_numpy(amaxes), fp8_max, rule).numpy()
        np.testing.assert_array_equal(got, expected)


def test_reciprocal_keeps_subnormal_results():
    """``scale_inv = 1 / scale`` for the largest scales is a float32 subnormal, which XLA's
    CPU division flushes; fp8train.jax rounds it exactly (numpy keeps subnormals)."""
    from fp8train.jax.cast import reciprocal

    rng = np.random.default_rng(4)
    scales = np.concatenate(
        [rng.uniform(2.0**126, 2.0**127, 2000), rng.uniform(2.0**127, 3.4e38, 2000), [2.0**126, 2.0**127, 3.4028235e38], rng.uniform(1e-30, 1e30, 2000)]
    ).astype(np.float32)
    got = np.asarray(jax.jit(reciprocal)(jnp.asarray(scales)))
    expected = np.float32(1.0) / scales
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_quantized_array_is_a_pytree_through_jit():
    qa = _quantize(jnp.ones((128, 256)), "block1x128", 0, "e4m3")
    assert isinstance(qa, fj.QuantizedArray) and qa.scale_inv.shape == (1, 256) and qa.axis == 0
    t = jax.jit(fj.transpose)(qa)
    assert t.data.shape == (256, 128) and t.axis == -1 and t.scale_inv.shape == (256, 1)
    np.testing.assert_array_equal(np.asarray(jax.jit(fj.QuantizedArray.dequantize)(qa)), np.ones((128, 256), np.float32))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: fj.quantize([1.0, 2.0], "row"), TypeError, "must be a JAX array.*jnp.asarray"),
        (lambda: fj.quantize(jnp.ones((4, 4)), "rows"), ValueError, "granularity='rows' is not one of tensor, row"),
        (lambda: fj.quantize(jnp.ones((4, 4)), "row", dtype=jnp.int8), ValueError, "dtype=int8 is not an FP8 or 4-bit data dtype; use jnp.float8_e4m3fn"),
        (lambda: fj.quantize(jnp.ones((4, 4), jnp.int32), "row"), ValueError, "takes float32, bfloat16 or float16 input, got int32"),
        (lambda: fj.quantize(jnp.ones((2, 4, 4)), "row", axis=1), ValueError, "axis=1 is not supported for a rank-3 input"),
        (lambda: fj.quantize(jnp.ones((64, 100)), "mx"), ValueError, r"divisible by 32; shape \(64, 100\) gives 64 x 100"),
        (lambda: fj.quantize(jnp.ones((128,)), "block1x128"), ValueError, "needs an array of rank >= 2"),
        (lambda: fj.quantize(jnp.ones((4, 4)), "row", scale=jnp.float32(2)), ValueError, "only supported for granularity 'tensor'"),
        (lambda: fj.quantize(jnp.ones((64, 64)), "mx", power_2_scales=False), ValueError, "E8M0 scales are powers of two"),
        (lambda: fj.quantize(jnp.ones((4, 4)), "row", amax_epsilon=-1.0), ValueError, "amax_epsilon=-1.0 must be"),
        (lambda: fj.quantize(jnp.ones((64, 64)), "mx", mx_scale_rule="floor"), ValueError, "mx_scale_rule='floor' must be 'ceil' or 'ocp'"),
        (lambda: fj.cast_to_fp8(jnp.ones(4), jnp.float16), ValueError, "dtype=float16 is not an FP8 data dtype"),
        # 4-bit errors: tests/jax/test_fp4.py
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_quantize_takes_a_rule_and_the_public_one_builds_it():
    from fp8train.jax.quantize import quantize as quantize_by_rule
    from fp8train.spec import E5M2, QuantRule

    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32) * 1e3)
    rule = QuantRule(granularity="mx", format=E5M2, amax_epsilon=1e-3, mx_scale_rule="ocp")
    by_rule = quantize_by_rule(x, rule, axis=0)
    public = fj.quantize(x, "mx", dtype=jnp.float8_e5m2, axis=0, amax_epsilon=1e-3, mx_scale_rule="ocp")
    assert (by_rule.granularity, by_rule.axis, by_rule.power_2_scales) == (public.granularity, 0, True)
    for a, b in ((by_rule.data, public.data), (by_rule.scale_inv, public.scale_inv)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    with pytest.raises(TypeError, match=r"rule must be a QuantRule \(fp8train.spec.QuantRule\), got str"):
        quantize_by_rule(x, "mx")
