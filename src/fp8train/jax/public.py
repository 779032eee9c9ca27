"""The public ``fp8train.jax.quantize``: a granularity and loose options in, one
:class:`~fp8train.spec.rule.QuantRule` built from them (by
:func:`~fp8train.spec.rule.build_quantize_rule`), :func:`fp8train.jax.quantize.quantize`
run with it (the twin of :mod:`fp8train.quant.public`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..spec.formats import E2M1, FloatFormat
from ..spec.granularities import Granularity
from ..spec.rule import build_quantize_rule
from .cast import FP8_DATA_DTYPES, check_array, format_of
from .quantize import QuantizedArray
from .quantize import quantize as quantize_by_rule

__all__ = ["quantize"]


def quantize(
    x: jax.Array,
    granularity: Granularity | str,
    *,
    dtype=None,
    axis: int = -1,
    power_2_scales: bool | None = None,
    amax_epsilon: float = 0.0,
    scale: jax.Array | None = None,
    mx_scale_rule: str = "ceil",
    amax_axis_name: str | tuple[str, ...] | None = None,
    rht: bool = False,
    stochastic_rounding: bool = False,
    key: jax.Array | None = None,
) -> QuantizedArray:
    """Quantize ``x`` to FP8 or 4 bits with one scale per scaling group (``NUMERICS.md``
    sections 2-3, 6), bit-identical to :func:`fp8train.quant.quantize` on the same values (data
    codes and scales; an FP8 NaN's code is NaN, its sign unspecified). Works under ``jax.jit``.

    Args:
        x: float32, bfloat16 or float16 array; ranks > 2 as their 2-D view ``(M, K)``.
        granularity: FP8: ``"tensor"``, ``"row"``, ``"block1x128"``, ``"block128x128"``, ``"mx"``;
            4-bit: ``"nvfp4"`` (1x16, E4M3 scales, a global amax), ``"nvfp4_2d"``, ``"mxfp4"``.
        dtype: ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``, ``jnp.float4_e2m1fn`` (4-bit:
            data packed two codes a ``uint8``); ``None``: E4M3, or E2M1 for 4-bit.
        axis: -1 puts the scaling groups along the last dim (rowwise usage), 0 along the
            first (columnwise usage). Ignored by ``tensor``, ``block128x128`` and ``nvfp4_2d``.
        power_2_scales: round scales down to powers of two; ``None``: the granularity's
            default (off for ``tensor`` and NVFP4, else on; ``mx``, ``mxfp4`` always).
        amax_epsilon: lower bound applied to each group's amax (0 for 4-bit).
        scale: a precomputed float32 scale (``tensor`` only, e.g. delayed scaling).
        mx_scale_rule: ``"ceil"`` (default) or ``"ocp"``; ``mx``, ``mxfp4`` only.
        amax_axis_name: ``tensor`` (and NVFP4's global amax) inside ``shard_map``: the
            mesh axis (or axes) whose shards make up the tensor, the amax their MAX. Not
            needed under ``jax.jit`` with sharded arrays (the amax is already global).
        rht: the random Hadamard transform along the scaling axis first (``nvfp4`` only).
        stochastic_rounding: round the E2M1 cast stochastically (4-bit), from ``key``, a
            JAX PRNG key: the same key, the same codes (:mod:`fp8train.jax.e2m1`: the map).

    Returns:
        A :class:`QuantizedArray`, ``data`` of ``x``'s shape (4-bit: ``[..., K/2]`` for
        axis -1, ``[M/2, K]`` for axis 0).

    Raises:
        ValueError: unknown granularity, unsupported dtype or axis, a shape the granularity
            cannot tile, a bad ``amax_epsilon`` or ``mx_scale_rule``, ``rht`` or
            ``stochastic_rounding`` where they do not apply or without a key.
        TypeError: ``x`` not an array, ``axis`` not an int, a flag not a bool.
    """
    x = check_array("x", x)
    rule = build_quantize_rule(
        granularity, _format_of_dtype(dtype), power_2_scales=power_2_scales, amax_epsilon=amax_epsilon,
        mx_scale_rule=mx_scale_rule, rht=rht, stochastic_rounding=stochastic_rounding,
    )
    return quantize_by_rule(x, rule, axis=axis, scale=scale, amax_axis_name=amax_axis_name, key=key)


def _format_of_dtype(dtype) -> FloatFormat | None:
    """The data format of ``dtype`` (``None``: the granularity's default)."""
    if dtype is None:
        return None
    if _is_dtype(dtype) and jnp.dtype(dtype) == jnp.dtype(jnp.float4_e2m1fn):
        return E2M1
    if not _is_dtype(dtype) or jnp.dtype(dtype) not in FP8_DATA_DTYPES:
        name = jnp.dtype(dtype).name if _is_dtype(dtype) else repr(dtype)
        raise ValueError(
            f"dtype={name} is not an FP8 or 4-bit data dtype; use jnp.float8_e4m3fn, jnp.float8_e5m2 "
            "or jnp.float4_e2m1fn"
        )
    return format_of(dtype)


def _is_dtype(dtype) -> bool:
    try:
        jnp.dtype(dtype)
    except TypeError:
        return False
    return True
