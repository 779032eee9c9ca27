"""The public ``fp8train.jax.quantize``: a granularity and loose options in, one
:class:`~fp8train.spec.rule.QuantRule` built from them, :func:`fp8train.jax.quantize.quantize`
run with it (the twin of :mod:`fp8train.quant.public`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..spec.granularities import Granularity
from ..spec.rule import QuantRule
from .cast import FP8_DATA_DTYPES, check_array, format_of
from .quantize import QuantizedArray, check_fp8_granularity
from .quantize import quantize as quantize_by_rule

__all__ = ["quantize"]


def quantize(
    x: jax.Array,
    granularity: Granularity | str,
    *,
    dtype=jnp.float8_e4m3fn,
    axis: int = -1,
    power_2_scales: bool | None = None,
    amax_epsilon: float = 0.0,
    scale: jax.Array | None = None,
    mx_scale_rule: str = "ceil",
    amax_axis_name: str | tuple[str, ...] | None = None,
) -> QuantizedArray:
    """Quantize ``x`` to FP8 with one scale per scaling group (``NUMERICS.md`` sections 2-3),
    bit-identical to :func:`fp8train.quantize` on the same values (data codes and scales;
    a NaN's code is NaN, its sign unspecified). Works under ``jax.jit``.

    Args:
        x: float32, bfloat16 or float16 array. Ranks > 2 behave as their 2-D view
            ``(prod(leading dims), last dim)``.
        granularity: ``"tensor"``, ``"row"``, ``"block1x128"``, ``"block128x128"`` or ``"mx"``.
        dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
        axis: -1 puts the scaling groups along the last dim (rowwise usage), 0 along the
            first (columnwise usage). Ignored by ``tensor`` and ``block128x128``.
        power_2_scales: round scales down to powers of two; ``None`` takes the granularity's
            default (off for ``tensor``, on for the others; ``mx`` always).
        amax_epsilon: lower bound applied to each group's amax.
        scale: a precomputed float32 scale (``tensor`` only, e.g. delayed scaling).
        mx_scale_rule: ``"ceil"`` (default) or ``"ocp"``; ``mx`` only.
        amax_axis_name: ``tensor`` granularity inside ``shard_map``: the mesh axis (or
            axes) whose shards make up the tensor; the amax is the MAX over them
            (``jax.lax.pmax``) before the scale is computed. Under ``jax.jit`` with sharded
            arrays no name is needed: the amax is already global.

    Returns:
        A :class:`QuantizedArray` whose ``data`` has ``x``'s shape.

    Raises:
        ValueError: unknown granularity, unsupported dtype or axis, a shape the granularity
            cannot tile, a negative or non-finite ``amax_epsilon``, an unknown ``mx_scale_rule``.
        TypeError: ``x`` not an array, ``axis`` not an int, ``power_2_scales`` not a bool.
        NotImplementedError: a 4-bit granularity (``nvfp4``, ``nvfp4_2d``, ``mxfp4``): not
            in the JAX frontend yet.
    """
    x = check_array("x", x)
    check_fp8_granularity(Granularity.coerce(granularity))
    if not _is_dtype(dtype) or jnp.dtype(dtype) not in FP8_DATA_DTYPES:
        name = jnp.dtype(dtype).name if _is_dtype(dtype) else repr(dtype)
        raise ValueError(f"dtype={name} is not an FP8 data dtype; use jnp.float8_e4m3fn or jnp.float8_e5m2")
    rule = QuantRule(
        granularity=granularity,
        format=format_of(dtype),
        power_2_scales=power_2_scales,
        amax_epsilon=amax_epsilon,
        mx_scale_rule=mx_scale_rule,
    )
    return quantize_by_rule(x, rule, axis=axis, scale=scale, amax_axis_name=amax_axis_name)


def _is_dtype(dtype) -> bool:
    try:
        jnp.dtype(dtype)
    except TypeError:
        return False
    return True
