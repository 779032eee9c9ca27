"""``fp8train.jax.scaled_matmul`` of two NVFP4 or two MXFP4 operands equals
``fp8train.quant.scaled_mm`` bit for bit on any values (each block's partial product is exact;
the blocks accumulate in order), NVFP4's alpha included down to subnormal values; and the
Flax layer's stochastic-rounding stream."""

from __future__ import annotations

import functools

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fp8train  # noqa: E402
import fp8train.jax as fj  # noqa: E402
from fp8train.spec.fp4_recipes import NVFP4Scaling  # noqa: E402

from ._common import every_class  # noqa: E402

M, N, K = 64, 96, 256
# (a granularity, b granularity, a's and b's magnitudes, out dtype): the two families, the
# 16x16 weight tiles, operands so small that NVFP4's alpha and the outputs are float32
# subnormals, MXFP4 blocks of a whose scales are 2^-127 (subnormal) times a large b.
# Two compiles by default (one per pair; bfloat16 outputs are in test_linear.py's layers).
CASES = [
    ("nvfp4", "nvfp4_2d", 1.0, 1.0, "float32"),
    ("nvfp4", "nvfp4_2d", 1e-18, 1e-18, "float32"),
    ("mxfp4", "mxfp4", 1.0, 1.0, "float32"),
    ("mxfp4", "mxfp4", 1e-38, 1e20, "float32"),
    pytest.param("mxfp4", "mxfp4", 1.0, 1.0, "bfloat16", marks=pytest.mark.slow),
]
_DTYPES = {"float32": (torch.float32, jnp.float32), "bfloat16": (torch.bfloat16, jnp.bfloat16)}


@functools.cache
def _matmul(ga, gb, out_dtype):
    return jax.jit(lambda a, b, bias: fj.scaled_matmul(fj.quantize(a, ga), fj.quantize(b, gb), out_dtype, bias=bias))


@pytest.mark.parametrize("ga, gb, magnitude_a, magnitude_b, dtype", CASES)
def test_bit_exact_on_any_values(ga, gb, magnitude_a, magnitude_b, dtype):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((M, K)) * magnitude_a).astype(np.float32)
    b = (rng.standard_normal((N, K)) * magnitude_b).astype(np.float32)
    bias = (rng.standard_normal(N) * magnitude_a * magnitude_b).astype(np.float32)
    torch_dtype, jax_dtype = _DTYPES[dtype]
    qa, qb = fp8train.quant.quantize(torch.from_numpy(a), ga), fp8train.quant.quantize(torch.from_numpy(b), gb)
    expected = fp8train.quant.scaled_mm(qa, qb, out_dtype=torch_dtype, bias=torch.from_numpy(bias).to(torch_dtype), backend="emulated")
    got = _matmul(ga, gb, jax_dtype)(jnp.asarray(a), jnp.asarray(b), jnp.asarray(bias).astype(jax_dtype))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)).view(np.uint32), expected.float().numpy().view(np.uint32))
    assert np.abs(expected.float().numpy()).max() > 0


@pytest.mark.slow
@pytest.mark.parametrize("ga, gb", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4")])
def test_equal_up_to_accumulation_order_on_operands_of_every_class(ga, gb):
    """Operands whose groups hold zeros, subnormals, tiny and huge values (no NaN or inf,
    which make the whole NVFP4 product NaN), float32 out. Partial sums that mix huge and
    tiny products are not exact in float32, so the two GEMMs (JAX's in block order,
    PyTorch's one folded GEMM) may differ by their float32 additions, as the contract
    allows: within K roundings of the sum of |products| (and a subnormal's step)."""
    # MXFP4's threshold class puts block scales near 2^127 in every row: every output
    # overflows (differently in the two forms, docs/numerics.md), so it is left out there.
    classes = ("normal", "zeros", "subnormal", "tiny") + (("mx_threshold",) if ga == "nvfp4" else ())
    a = every_class("float32", ga, -1, (M, K), 0, classes)
    b = every_class("float32", gb, -1, (N, K), 3, classes)
    qa, qb = fp8train.quant.quantize(torch.from_numpy(a), ga), fp8train.quant.quantize(torch.from_numpy(b), gb)
    expected = fp8train.quant.scaled_mm(qa, qb, out_dtype=torch.float32, backend="emulated").numpy()
    got = np.asarray(_matmul(ga, gb, jnp.float32)(jnp.asarray(a), jnp.asarray(b), None))
    magnitude = qa.dequantize().double().abs().numpy() @ qb.dequantize().double().abs().numpy().T
    bound = K * 2.0**-24 * magnitude + K * 2.0**-149
    finite = np.isfinite(expected)
    assert (np.isfinite(got) == finite).all()
    error = np.abs(got[finite].astype(np.float64) - expected[finite])
    assert (error <= bound[finite]).all(), (error - bound[finite]).max()
    assert (got.view(np.uint32) == expected.view(np.uint32)).mean() > 0.5  # mostly exact sums


def test_a_nan_makes_the_nvfp4_output_nan_and_families_do_not_mix():
    a = np.ones((M, K), np.float32)
    a[0, 0] = np.nan
    out = _matmul("nvfp4", "nvfp4_2d", jnp.float32)(jnp.asarray(a), jnp.ones((N, K)), jnp.zeros(N))
    assert bool(jnp.isnan(out).all())
    nvfp4, mxfp4 = (jax.eval_shape(lambda: fj.quantize(jnp.ones((32, 64)), g)) for g in ("nvfp4", "mxfp4"))
    with pytest.raises(NotImplementedError):
        fj.scaled_matmul(nvfp4, mxfp4)


def test_flax_dense_draws_stochastic_rounding_from_its_rng_stream():
    """``Dense(recipe="nvfp4")``: init needs no rounding stream; apply without it names the
    fix; the round-to-nearest NVFP4 layer runs without one (traced only: no compile)."""
    pytest.importorskip("flax")
    x = jnp.ones((4, 32))
    layer = fj.Dense(32, recipe="nvfp4")
    params = jax.eval_shape(layer.init, jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"got no 'stochastic_rounding' RNG: pass rngs=\{'stochastic_rounding': key\}"):
        jax.eval_shape(layer.apply, params, x)
    y = jax.eval_shape(fj.Dense(32, recipe=NVFP4Scaling(disable_stochastic_rounding=True)).apply, params, x)
    assert y.shape == (4, 32)


@pytest.mark.slow
def test_flax_dense_nvfp4_gradients_follow_the_key():
    pytest.importorskip("flax")
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 32)), jnp.float32)
    layer = fj.Dense(32, recipe="nvfp4")
    params = layer.init(jax.random.key(0), x)
    grad = jax.jit(
        lambda p, key: jax.grad(lambda p: jnp.sum(layer.apply(p, x, rngs={fj.STOCHASTIC_ROUNDING: key}) ** 2))(p)
    )
    g0, g0_again, g1 = grad(params, jax.random.key(1)), grad(params, jax.random.key(1)), grad(params, jax.random.key(2))
    kernel = lambda g: np.asarray(g["params"]["kernel"])  # noqa: E731
    np.testing.assert_array_equal(kernel(g0), kernel(g0_again))
    assert (kernel(g0) != kernel(g1)).any()


def test_swizzled_4bit_scales_are_the_hardware_gemms():
    """``swizzle_mx_scales`` of NVFP4 (E4M3) and MXFP4 (E8M0) block scales, 16x16 tiles
    repeated over their rows first, is the layout ``torch._scaled_mm`` takes for 4-bit
    operands (``fp8train.quant.gemm.hardware.hardware_scales``), byte for byte."""
    from fp8train.quant.gemm.hardware import hardware_scales

    x = np.random.default_rng(9).standard_normal((M, K)).astype(np.float32)
    for ga, gb in (("nvfp4", "nvfp4_2d"), ("mxfp4", "mxfp4")):
        expected = hardware_scales(fp8train.quant.quantize(torch.from_numpy(x), ga), fp8train.quant.quantize(torch.from_numpy(x), gb))
        for granularity, scales in zip((ga, gb), expected):
            got = _swizzled_scales(granularity)(jnp.asarray(x))
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8).reshape(-1), scales.view(torch.uint8).numpy())


@functools.cache
def _swizzled_scales(granularity):
    def swizzled(x):
        qa = fj.quantize(x, granularity)
        rows = qa.group_shape[0]
        return fj.swizzle_mx_scales(jnp.repeat(qa.scale_inv, rows, axis=0) if rows > 1 else qa.scale_inv)

    return jax.jit(swizzled)
