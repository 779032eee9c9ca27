"""Shared by the JAX frontend's tests: inputs of every class, and comparisons of JAX
results with fp8train's PyTorch functions on the same values."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

JAX_FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
NUMPY_FLOAT = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TORCH_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
JAX_FLOAT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _near(value: float, num_ulps: int) -> np.ndarray:
    """float32 values within ``num_ulps`` of ``value``, in order."""
    center = np.array(value, np.float32).view(np.int32)
    return (center + np.arange(-num_ulps, num_ulps + 1, dtype=np.int32)).view(np.float32)


def mx_threshold_amaxes() -> np.ndarray:
    """Amaxes around the float32 values where MXFP8's ``t = amax / fp8_max`` crosses 2^-127
    and 2^-126 (t a float32 subnormal: the hardware's rounding up, which XLA's CPU would
    flush), for both data formats."""
    values = [_near(fp8_max * 2.0**exponent, 6) for fp8_max in FP8_MAX.values() for exponent in (-127, -126)]
    return np.concatenate(values)


CLASSES = ("normal", "zeros", "subnormal", "tiny", "nan", "inf", "huge", "mx_threshold")
"""Input classes, one per scaling group: values spread over the dtype's whole exponent range;
signed zeros; subnormals; tiny normals (their scale overflows, so scale_inv is a float32
subnormal); NaN among normal values; infinities among values to saturate; values near the
dtype's largest; MXFP8 threshold amaxes (the group's largest value, the rest smaller)."""


def _group_values(kind: str, shape, dtype: str, rng, group_index: int) -> np.ndarray:
    info = ml_dtypes.finfo(NUMPY_FLOAT[dtype])
    tiny, smallest_subnormal, dtype_max = float(info.smallest_normal), float(info.smallest_subnormal), float(info.max)
    signs = rng.choice([-1.0, 1.0], shape)
    if kind == "mx_threshold" and dtype == "float16":
        kind = "normal"  # the thresholds lie below float16's range
    if kind == "normal":
        low, high = int(np.log2(smallest_subnormal)) + 1, int(np.log2(dtype_max)) - 1
        return rng.standard_normal(shape) * np.exp2(rng.integers(low, high, shape))
    if kind == "zeros":
        return signs * 0.0
    if kind == "subnormal":
        return signs * rng.uniform(smallest_subnormal, tiny, shape)
    if kind == "tiny":
        return signs * rng.uniform(1, 2, shape) * tiny * 8
    if kind == "nan":
        values = rng.standard_normal(shape)
        values.flat[rng.integers(values.size)] = np.nan
        return values
    if kind == "inf":
        values = rng.standard_normal(shape) * 1e5
        values.flat[rng.integers(values.size)] = np.inf * signs.flat[0]
        return values
    if kind == "huge":
        return signs * rng.uniform(0.5, 1.0, shape) * dtype_max
    amaxes = mx_threshold_amaxes()
    amax = float(amaxes[group_index % len(amaxes)])
    values = signs * rng.uniform(0, 0.5, shape) * amax
    values.flat[rng.integers(values.size)] = amax * signs.flat[0]
    return values


def every_class(
    dtype: str, granularity: str, axis: int, shape=(384, 384), seed: int = 0, classes: tuple[str, ...] = CLASSES
) -> np.ndarray:
    """A ``shape`` input (float32 values exact in ``dtype``) whose scaling groups, for this
    granularity and axis (the groups of :class:`fp8train.spec.granularities.Granularity`),
    each hold one input class of ``classes`` (default :data:`CLASSES`), in turn (``seed``
    shifts the turn: the one group of ``tensor`` takes class ``seed``)."""
    from fp8train.spec.granularities import Granularity

    rng = np.random.default_rng(seed)
    rows, cols = Granularity(granularity).group_shape(axis, shape)
    x = np.empty(shape, np.float64)
    num_col_groups = shape[1] // cols
    for gi in range(shape[0] // rows):
        for gj in range(num_col_groups):
            index = gi * num_col_groups + gj
            kind = classes[(index + seed) % len(classes)]
            x[gi * rows : (gi + 1) * rows, gj * cols : (gj + 1) * cols] = _group_values(kind, (rows, cols), dtype, rng, index)
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(NUMPY_FLOAT[dtype]).astype(np.float32)


def fp8_codes_equal(jax_data, torch_data) -> None:
    """Assert the same codes, NaN for NaN (a NaN's sign is not part of the contract)."""
    j = np.asarray(jax_data)
    t = torch_data.contiguous().view(torch.uint8).numpy()
    assert j.shape == t.shape, (j.shape, t.shape)
    j_values, t_values = j.astype(np.float32), torch_data.float().numpy()
    j_nan, t_nan = np.isnan(j_values), np.isnan(t_values)
    np.testing.assert_array_equal(j_nan, t_nan)
    codes_j, codes_t = j.view(np.uint8)[~j_nan], t[~t_nan]
    mismatches = np.flatnonzero(codes_j != codes_t)
    assert mismatches.size == 0, f"{mismatches.size} codes differ, first: jax {codes_j[mismatches[:5]]} torch {codes_t[mismatches[:5]]}"


def scales_equal(jax_scale_inv, torch_scale_inv) -> None:
    """Assert bit-identical ``scale_inv`` (float32 bits, or E8M0 codes)."""
    j = np.asarray(jax_scale_inv)
    if torch_scale_inv.dtype == torch.float8_e8m0fnu:
        t = torch_scale_inv.view(torch.uint8).numpy()
        j = j.view(np.uint8)
    else:
        t = torch_scale_inv.numpy().view(np.uint32)
        j = j.astype(np.float32).view(np.uint32)
    assert j.shape == t.shape, (j.shape, t.shape)
    mismatches = np.flatnonzero(j.reshape(-1) != t.reshape(-1))
    assert mismatches.size == 0, f"{mismatches.size} scales differ, first: jax {j.reshape(-1)[mismatches[:5]]} torch {t.reshape(-1)[mismatches[:5]]}"


def to_jax(x: np.ndarray, dtype: str):
    return jnp.asarray(x.astype(NUMPY_FLOAT[dtype]))


def to_torch(x: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(TORCH_FLOAT[dtype])


_QUANTIZE_CACHE: dict = {}


def jquantize(x, granularity, **options):
    """``fp8train.jax.quantize`` under ``jax.jit``, one compiled function per set of static
    options, shared by every test of the session (eager JAX compiles op by op: slower)."""
    import jax

    import fp8train.jax as fj

    key = (granularity, tuple(sorted((k, str(v)) for k, v in options.items())))
    if key not in _QUANTIZE_CACHE:
        _QUANTIZE_CACHE[key] = jax.jit(lambda v: fj.quantize(v, granularity, **options))
    return _QUANTIZE_CACHE[key](x)
