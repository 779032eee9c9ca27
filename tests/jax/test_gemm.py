"""``fp8train.jax.scaled_matmul`` against ``fp8train.quant.scaled_mm(backend="emulated")`` on the
same operands: bit-exact where every float32 partial sum is exact (then accumulation order
cannot matter), else within float32 accumulation error; and the layouts against PyTorch's."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fp8train  # noqa: E402
import fp8train.jax as fj  # noqa: E402
from fp8train.quant.kernels import use_quant_settings  # noqa: E402

from ._common import JAX_FP8, TORCH_FP8, jquantize  # noqa: E402

# (a granularity, b granularity, power_2_scales, a format, b format)
PAIRS = [
    ("tensor", "tensor", False, "e4m3", "e5m2"),
    ("row", "row", True, "e4m3", "e4m3"),
    ("block1x128", "block128x128", True, "e4m3", "e4m3"),
    ("block1x128", "block1x128", False, "e5m2", "e4m3"),
    ("mx", "mx", True, "e4m3", "e5m2"),
]


@pytest.fixture(autouse=True)
def _float32_torch_gemm():
    # PyTorch's emulation picks a bfloat16 GEMM on CPUs with native bf16, equal to its
    # float32 GEMM up to accumulation order; compare with the float32 one, as JAX's is.
    with use_quant_settings(emulated_gemm="float32"):
        yield


def exact_sum_values(shape, rng, magnitude=1.0) -> np.ndarray:
    """Values whose FP8 codes, under any scale of these recipes, are at least 8 (E4M3) or
    1024 (E5M2) times the format's smallest step: every partial sum of a GEMM of them is
    exact in float32, whatever the order (integers k/16 with 10 <= k <= 100, random signs)."""
    return (rng.integers(10, 101, shape) * rng.choice([-1, 1], shape) / 16 * magnitude).astype(np.float32)


def _operands(x_a, x_b, pair):
    ga, gb, power_2, fa, fb = pair
    qa = jquantize(jnp.asarray(x_a), ga, dtype=JAX_FP8[fa], power_2_scales=power_2)
    qb = jquantize(jnp.asarray(x_b), gb, dtype=JAX_FP8[fb], power_2_scales=power_2)
    ta = fp8train.quant.quantize(torch.from_numpy(x_a), ga, dtype=TORCH_FP8[fa], power_2_scales=power_2)
    tb = fp8train.quant.quantize(torch.from_numpy(x_b), gb, dtype=TORCH_FP8[fb], power_2_scales=power_2)
    return qa, qb, ta, tb


_MATMUL = jax.jit(fj.scaled_matmul, static_argnums=(2,))


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}-p2{p[2]}")
def test_bit_exact_where_partial_sums_are_exact(pair):
    rng = np.random.default_rng(0)
    # K = 384: three 128-value chunks, so the chunk order of the promotion matters.
    x_a, x_b = exact_sum_values((128, 384), rng), exact_sum_values((256, 384), rng, 1 / 4)
    bias = rng.standard_normal(256).astype(np.float32)
    qa, qb, ta, tb = _operands(x_a, x_b, pair)
    for out_dtype, torch_dtype in ((jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16)):
        got = _MATMUL(qa, qb, out_dtype, bias=jnp.asarray(bias))
        expected = fp8train.quant.scaled_mm(ta, tb, torch_dtype, backend="emulated", bias=torch.from_numpy(bias))
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), expected.float().numpy())


@pytest.mark.parametrize("pair", [PAIRS[0], PAIRS[4]], ids=["tensor", "block-chunked"])
def test_within_float32_accumulation_error_on_any_values(pair):
    """Random values over a wide range: both frameworks sum in float32 in their own order;
    each differs from the exact sum by at most gamma_K * sum|a_i b_i| (K products,
    gamma_K = K * 2^-24), so they differ from each other by at most twice that."""
    rng = np.random.default_rng(1)
    x_a = (rng.standard_normal((128, 384)) * np.exp2(rng.integers(-8, 8, (128, 384)))).astype(np.float32)
    x_b = rng.standard_normal((128, 384)).astype(np.float32)
    qa, qb, ta, tb = _operands(x_a, x_b, pair)
    got = np.asarray(_MATMUL(qa, qb, jnp.float32)).astype(np.float64)
    expected = fp8train.quant.scaled_mm(ta, tb, torch.float32, backend="emulated").double().numpy()
    a_hp, b_hp = ta.dequantize().double().numpy(), tb.dequantize().double().numpy()
    bound = 2 * 384 * 2.0**-24 * (np.abs(a_hp) @ np.abs(b_hp).T)
    assert (np.abs(got - expected) <= bound).all()


def test_layouts_match_pytorch():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 384)).astype(np.float32)
    for granularity in ("block1x128", "block128x128"):
        for axis in (-1, 0):
            data, scales = jax.jit(fj.blockwise_to_gemm_layout)(jquantize(jnp.asarray(x), granularity, axis=axis))
            t_data, t_scales = fp8train.quant.blockwise_to_gemm_layout(fp8train.quant.quantize(torch.from_numpy(x), granularity, axis=axis))
            np.testing.assert_array_equal(np.asarray(data).view(np.uint8), t_data.view(torch.uint8).numpy())
            np.testing.assert_array_equal(np.asarray(scales), t_scales.numpy())
    for axis in (-1, 0):
        scales = jquantize(jnp.asarray(x[:, :352] * 1e3), "mx", axis=axis).scale_inv
        t_scales = fp8train.quant.quantize(torch.from_numpy(x[:, :352] * 1e3), "mx", axis=axis).scale_inv
        swizzled = jax.jit(fj.swizzle_mx_scales, static_argnames="axis")(scales, axis=axis)
        t_swizzled = fp8train.quant.swizzle_mx_scales(t_scales, axis=axis)
        np.testing.assert_array_equal(np.asarray(swizzled).view(np.uint8), t_swizzled.view(torch.uint8).numpy())
        back = jax.jit(fj.unswizzle_mx_scales, static_argnums=1, static_argnames="axis")(swizzled, scales.shape, axis=axis)
        np.testing.assert_array_equal(np.asarray(back).view(np.uint8), np.asarray(scales).view(np.uint8))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda a, b: fj.scaled_matmul(a, jquantize(jnp.ones((64, 64)), "row", axis=0)), ValueError, r"axis=0\); the GEMM contracts the last dim. Pass transpose\(b\)"),
        (lambda a, b: fj.scaled_matmul(a, jquantize(jnp.ones((64, 32)), "row")), ValueError, r"contraction dims differ: a is \(64, 64\), b is \(64, 32\)"),
        (lambda a, b: fj.scaled_matmul(a, b, jnp.int8), ValueError, "out_dtype=<class 'jax.numpy.int8'> must be float32, bfloat16 or float16|out_dtype=int8"),
        (lambda a, b: fj.scaled_matmul(a, jquantize(jnp.ones((64, 64)), "mx")), NotImplementedError, "no FP8 GEMM mixes 'row' with 'mx'"),
        (lambda a, b: fj.scaled_matmul(a, b, bias=jnp.ones(3)), ValueError, r"bias of shape \(3,\) must be \[N\] = \[64\]"),
        (lambda a, b: fj.scaled_matmul(a, "b"), TypeError, "b must be a QuantizedArray"),
    ],
)
def test_bad_operands_are_named(call, error, match):
    a = jquantize(jnp.ones((64, 64)), "row")
    with pytest.raises(error, match=match):
        call(a, a)
