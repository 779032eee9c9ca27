"""Quantization in JAX: a high-precision array in, a :class:`QuantizedArray` out, bit for
bit what :func:`fp8train.quantize` gives for the same values.

Every granularity is one rule over scaling groups of the 2-D view ``(M, K)`` of the input
(leading dims flattened), read from :class:`fp8train.spec.granularities.Granularity`; the
scale rules are in :mod:`fp8train.jax.scaling`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..spec.checks import check_bool, check_number
from ..spec.granularities import Granularity, normalize_axis
from ..spec.recipes import MX_SCALE_RULES
from .cast import (
    FLOAT32_MAX,
    FP8_DATA_DTYPES,
    HIGH_PRECISION_DTYPES,
    cast_to_fp8,
    check_array,
    exp2_int,
    format_of,
    from_bits,
    jax_dtype,
    magnitude_bits,
    reciprocal,
    scaled_product,
    to_float32,
)
from .scaling import amax_to_scale, e8m0_to_float32, mx_scale_exponent

__all__ = ["QuantizedArray", "quantize", "transpose", "view_2d_shape"]

_E8M0 = jnp.dtype(jnp.float8_e8m0fnu)


def view_2d_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(M, K)`` of the 2-D view of ``shape``: leading dims flattened into M."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return math.prod(shape[:-1]), shape[-1]


@dataclass(frozen=True)
class QuantizedArray:
    """FP8 data with its scales: ``x ~= data * scale_inv``, ``scale_inv`` broadcast over each
    scaling group. A JAX pytree (``data`` and ``scale_inv`` are its leaves), so it passes
    through ``jax.jit`` and ``jax.tree_util``.

    Attributes:
        data: ``float8_e4m3fn`` or ``float8_e5m2`` array of the input's shape.
        scale_inv: per-group inverse scales in the compact layout of
            :class:`fp8train.QuantizedTensor`, relative to the 2-D view ``(M, K)``:
            ``tensor`` ``()``; ``row`` ``(M,1)`` (axis -1) or ``(1,K)`` (axis 0);
            ``block1x128`` ``(M,K/128)`` or ``(M/128,K)``; ``block128x128``
            ``(M/128,K/128)``; ``mx`` ``(M,K/32)`` or ``(M/32,K)`` as ``float8_e8m0fnu``;
            float32 for every granularity but ``mx``.
        granularity: a :class:`~fp8train.spec.granularities.Granularity` (static).
        axis: -1 (groups along the last dim) or 0 (along the first) (static).
        power_2_scales: every scale is a power of two (static; always for ``mx``).
    """

    data: jax.Array
    scale_inv: jax.Array
    granularity: Granularity
    axis: int = -1
    power_2_scales: bool = False

    def __post_init__(self) -> None:
        # Only the static fields are checked: JAX rebuilds pytrees with placeholder leaves.
        object.__setattr__(self, "granularity", Granularity.coerce(self.granularity))
        if isinstance(self.axis, bool) or self.axis not in (-1, 0):
            raise ValueError(f"axis={self.axis!r} must be -1 (rowwise usage) or 0 (columnwise usage)")
        check_bool("power_2_scales", self.power_2_scales)

    @property
    def dtype(self):
        """FP8 dtype of :attr:`data`."""
        return self.data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of :attr:`data`."""
        return self.data.shape

    @property
    def group_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of one scaling group in the 2-D view of :attr:`data`."""
        return self.granularity.group_shape(self.axis, view_2d_shape(self.data.shape))

    def scale_inv_float32(self) -> jax.Array:
        """:attr:`scale_inv` as float32 (E8M0 decoded from bits), same shape."""
        if self.granularity.e8m0_scales:
            return e8m0_to_float32(self.scale_inv)
        return self.scale_inv.astype(jnp.float32)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``data * scale_inv`` (in float32) as ``dtype``, in the input's shape."""
        m, k = view_2d_shape(self.data.shape)
        if self.data.size == 0:
            return jnp.zeros(self.data.shape, dtype)
        rows, cols = self.group_shape
        values = self.data.astype(jnp.float32).reshape(m // rows, rows, k // cols, cols)
        scale_inv = self.scale_inv_float32().reshape(m // rows, 1, k // cols, 1)
        return scaled_product(values, scale_inv).reshape(self.data.shape).astype(dtype)


# granularity, axis and power_2_scales are static (pytree metadata), data and scale_inv leaves.
jax.tree_util.register_dataclass(
    QuantizedArray, data_fields=["data", "scale_inv"], meta_fields=["granularity", "axis", "power_2_scales"]
)


def _check_shape(shape: tuple[int, ...], granularity: Granularity) -> None:
    if len(shape) < granularity.min_rank:
        raise ValueError(
            f"granularity {str(granularity)!r} needs an array of rank >= {granularity.min_rank}, got shape {shape}"
        )
    block = granularity.block
    if not block:
        return
    m, k = view_2d_shape(shape)
    if k % block or m % block:
        raise ValueError(
            f"granularity {str(granularity)!r} needs the last dim and the product of the other dims to "
            f"be divisible by {block}; shape {shape} gives {m} x {k}. Pad the array, or skip FP8 for this layer"
        )


def _check_arguments(x, granularity, dtype, axis, power_2_scales, amax_epsilon, scale, mx_scale_rule) -> int:
    if not _is_dtype(dtype) or jnp.dtype(dtype) not in FP8_DATA_DTYPES:
        name = jnp.dtype(dtype).name if _is_dtype(dtype) else repr(dtype)
        raise ValueError(f"dtype={name} is not an FP8 data dtype; use jnp.float8_e4m3fn or jnp.float8_e5m2")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"quantize takes float32, bfloat16 or float16 input, got {x.dtype}")
    axis = -1 if granularity.per_tensor else normalize_axis(axis, x.ndim)
    _check_shape(tuple(x.shape), granularity)
    if scale is not None and not granularity.per_tensor:
        raise ValueError(f"a precomputed scale is only supported for granularity 'tensor', not {str(granularity)!r}")
    if scale is not None and (scale.size != 1 or not jnp.issubdtype(scale.dtype, jnp.floating)):
        raise ValueError(f"scale must be a one-element floating-point array, got shape {tuple(scale.shape)} of {scale.dtype}")
    if power_2_scales is not None:
        check_bool("power_2_scales", power_2_scales)
    if granularity.always_power_2 and power_2_scales is False:
        raise ValueError(f"power_2_scales=False is not possible for {str(granularity)!r}: E8M0 scales are powers of two")
    check_number("amax_epsilon", amax_epsilon, minimum=0)
    if not isinstance(mx_scale_rule, str) or mx_scale_rule not in MX_SCALE_RULES:
        raise ValueError(f"mx_scale_rule={mx_scale_rule!r} must be 'ceil' or 'ocp'")
    return axis


def _is_dtype(dtype) -> bool:
    try:
        jnp.dtype(dtype)
    except TypeError:
        return False
    return True


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
    """
    x = check_array("x", x)
    granularity = Granularity.coerce(granularity)
    if scale is not None:
        scale = check_array("scale", scale)
    axis = _check_arguments(x, granularity, dtype, axis, power_2_scales, amax_epsilon, scale, mx_scale_rule)
    if power_2_scales is None:
        power_2_scales = granularity.default_power_2_scales
    fmt = format_of(dtype)
    m, k = view_2d_shape(tuple(x.shape))
    rows, cols = granularity.group_shape(axis, (m, k))
    groups = to_float32(x).reshape(m // rows if rows else 1, rows, k // cols if cols else 1, cols)
    if scale is not None:
        group_scale = scale.astype(jnp.float32).reshape(1, 1, 1, 1)
        scale_inv = reciprocal(group_scale)
    else:
        amax_bits = jnp.max(magnitude_bits(groups), axis=(1, 3), keepdims=True, initial=0)
        if amax_axis_name is not None and granularity.per_tensor:
            amax_bits = lax.pmax(amax_bits, amax_axis_name)
        group_scale, scale_inv = _group_scales(
            from_bits(amax_bits), granularity, fmt.max, x.dtype, power_2_scales, amax_epsilon, mx_scale_rule
        )
    data = cast_to_fp8(scaled_product(groups, group_scale), jax_dtype(fmt))
    scale_inv = scale_inv.reshape(m // rows if rows else 1, k // cols if cols else 1)
    if granularity.e8m0_scales:
        scale_inv = lax.bitcast_convert_type(scale_inv, _E8M0)
    if granularity.per_tensor:
        scale_inv = scale_inv.reshape(())
    return QuantizedArray(
        data=data.reshape(x.shape),
        scale_inv=scale_inv,
        granularity=granularity,
        axis=axis,
        power_2_scales=granularity.always_power_2 or (power_2_scales and scale is None),
    )


def _group_scales(amax, granularity: Granularity, fp8_max, x_dtype, power_2_scales, amax_epsilon, mx_scale_rule):
    """``(scale, scale_inv)`` of every group; E8M0 ``scale_inv`` as its uint8 exponent."""
    if granularity.e8m0_scales:
        if amax_epsilon > 0:
            amax = _raise_to_epsilon(amax, amax_epsilon)
        exponent = mx_scale_exponent(amax, fp8_max, mx_scale_rule)
        scale = exp2_int(127 - exponent.astype(jnp.int32))
        # A NaN anywhere in a block makes the whole block NaN.
        scale = jnp.where(exponent == 0xFF, np.float32(np.nan), scale)
        return scale, exponent
    # Block scales that overflow take the input dtype's largest value (NUMERICS.md).
    inf_scale_value = float(jnp.finfo(x_dtype).max) if granularity.block else FLOAT32_MAX
    scale = amax_to_scale(
        amax, fp8_max, power_2_scales=power_2_scales, amax_epsilon=amax_epsilon, inf_scale_value=inf_scale_value
    )
    return scale, reciprocal(scale)


def _raise_to_epsilon(amax: jax.Array, amax_epsilon: float) -> jax.Array:
    """``amax`` raised to ``amax_epsilon`` where below it (compared on bits: subnormals count)."""
    epsilon_bits = int(np.array(amax_epsilon, np.float32).view(np.int32))
    return jnp.where(magnitude_bits(amax) < epsilon_bits, np.float32(amax_epsilon), amax)


def transpose(qa: QuantizedArray) -> QuantizedArray:
    """The transpose of a 2-D-viewed :class:`QuantizedArray`: data ``[A, B]`` becomes
    ``[B, A]`` and the scales follow, so a tensor quantized along its first dim (``axis=0``)
    becomes a K-last GEMM operand and vice versa. ``tensor`` and ``block128x128`` keep their
    axis (one scale, or square tiles that transpose with the data)."""
    data = qa.data.reshape(view_2d_shape(tuple(qa.data.shape))).T
    scale_inv = qa.scale_inv if qa.scale_inv.ndim == 0 else qa.scale_inv.T
    axis = qa.axis if qa.granularity.symmetric else (0 if qa.axis == -1 else -1)
    return QuantizedArray(data=data, scale_inv=scale_inv, granularity=qa.granularity, axis=axis, power_2_scales=qa.power_2_scales)
