"""Quantization in JAX: a high-precision array and a :class:`~fp8train.spec.rule.QuantRule`
in, a :class:`QuantizedArray` out, bit for bit what :func:`fp8train.quant.quantize.quantize`
gives for the same values and rule.

Every granularity is one rule over scaling groups of the 2-D view ``(M, K)`` of the input
(leading dims flattened), read from :class:`fp8train.spec.granularities.Granularity`; the
scale rules are in :mod:`fp8train.jax.scaling`, the 4-bit ones (NVFP4, MXFP4) in
:mod:`fp8train.jax.fp4_quantize`. The public ``fp8train.jax.quantize`` (a
granularity and options) builds a rule and calls :func:`quantize` (:mod:`fp8train.jax.public`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..spec.checks import check_bool, check_type
from ..spec.granularities import Granularity, view_2d_shape
from ..spec.rule import QuantRule
from .cast import (
    FLOAT32_MAX,
    HIGH_PRECISION_DTYPES,
    cast_to_fp8,
    check_array,
    exp2_int,
    from_bits,
    jax_dtype,
    magnitude_bits,
    reciprocal,
    scaled_product,
    to_float32,
)
from .e2m1 import e2m1_to_float32, pack_e2m1, unpack_e2m1
from .fp4_quantize import nvfp4_global_scales, quantize_fp4
from .ieee import exact_multiply
from .scaling import amax_to_scale, e8m0_to_float32, mx_scale_exponent

__all__ = ["QuantizedArray", "quantize", "transpose"]

_E8M0 = jnp.dtype(jnp.float8_e8m0fnu)


@dataclass(frozen=True)
class QuantizedArray:
    """FP8 or 4-bit data with its scales: ``x ~= data * scale_inv``, ``scale_inv`` broadcast
    over each scaling group (NVFP4: ``x ~= (data * scale_inv) * gd``, ``gd`` from
    ``global_amax``). A JAX pytree (``data``, ``scale_inv`` and ``global_amax`` are its
    leaves), so it passes through ``jax.jit`` and ``jax.tree_util``.

    Attributes:
        data: ``float8_e4m3fn`` or ``float8_e5m2`` array of the input's shape; 4-bit
            granularities: ``uint8``, two E2M1 codes a byte along the scaling axis (the
            bytes of PyTorch's ``torch.float4_e2m1fn_x2``): ``[..., K/2]`` for axis -1,
            ``[M/2, K]`` for axis 0.
        scale_inv: per-group inverse scales in the compact layout of
            :class:`fp8train.quant.QuantizedTensor`, relative to the 2-D view ``(M, K)``:
            ``tensor`` ``()``; ``row`` ``(M,1)`` (axis -1) or ``(1,K)`` (axis 0);
            ``block1x128`` ``(M,K/128)`` or ``(M/128,K)``; ``block128x128``
            ``(M/128,K/128)``; ``mx`` ``(M,K/32)`` or ``(M/32,K)`` as ``float8_e8m0fnu``;
            float32 for the other FP8 granularities. 4-bit: ``nvfp4`` ``(M,K/16)`` or
            ``(M/16,K)``, ``nvfp4_2d`` ``(M/16,K/16)`` as ``float8_e4m3fn``; ``mxfp4``
            ``(M,K/32)`` or ``(M/32,K)`` as ``float8_e8m0fnu``.
        granularity: a :class:`~fp8train.spec.granularities.Granularity` (static).
        axis: -1 (groups along the last dim) or 0 (along the first) (static).
        power_2_scales: every scale is a power of two (static; always for ``mx``, ``mxfp4``).
        global_amax: NVFP4 only (``nvfp4``, ``nvfp4_2d``): the float32 scalar amax of the
            tensor that was quantized (after the transform, if any); ``None`` otherwise.
    """

    data: jax.Array
    scale_inv: jax.Array
    granularity: Granularity
    axis: int = -1
    power_2_scales: bool = False
    global_amax: jax.Array | None = None

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
    def unpacked_shape_2d(self) -> tuple[int, int]:
        """``(M, K)`` of the 2-D view of the values :attr:`data` holds (4-bit data holds
        two a byte along the scaling axis)."""
        return self.granularity.values_shape_2d(self.data.shape, self.axis)

    @property
    def group_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of one scaling group in the 2-D view of the values."""
        return self.granularity.group_shape(self.axis, self.unpacked_shape_2d)

    def scale_inv_float32(self) -> jax.Array:
        """:attr:`scale_inv` as float32 (E8M0 decoded from bits), same shape."""
        if self.granularity.e8m0_scales:
            return e8m0_to_float32(self.scale_inv)
        return self.scale_inv.astype(jnp.float32)

    def scales_per_k_chunk(self, chunk: int) -> jax.Array:
        """The float32 scale of every (row, K chunk) of this K-last operand, ``[rows, K / chunk]``
        (``chunk`` divides the groups along K, or they span all of K); tiles repeated over rows."""
        rows, k = self.unpacked_shape_2d
        group_rows, group_cols = self.group_shape
        scale_inv = jnp.repeat(self.scale_inv_float32().reshape(rows // group_rows, k // group_cols), group_rows, axis=0)
        if group_cols == k:
            return jnp.broadcast_to(scale_inv, (rows, k // chunk))
        return jnp.repeat(scale_inv, group_cols // chunk, axis=1)

    def values_float32(self) -> jax.Array:
        """The unscaled data values as float32: :attr:`data`'s shape for FP8, the 2-D view
        :attr:`unpacked_shape_2d` (codes unpacked) for 4-bit data."""
        if not self.granularity.fp4:
            return self.data.astype(jnp.float32)
        return e2m1_to_float32(unpack_e2m1(self.data.reshape(view_2d_shape(self.data.shape)), self.axis))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``data * scale_inv`` (in float32; NVFP4: ``(data * scale_inv) * gd``) as ``dtype``,
        in the input's shape (4-bit: the last dim doubled for axis -1, the 2-D view
        ``[M, K]`` for axis 0)."""
        m, k = self.unpacked_shape_2d
        shape = self._unpacked_shape()
        if self.data.size == 0:
            return jnp.zeros(shape, dtype)
        rows, cols = self.group_shape
        values = self.values_float32().reshape(m // rows, rows, k // cols, cols)
        scale_inv = self.scale_inv_float32().reshape(m // rows, 1, k // cols, 1)
        # 4-bit: MXFP4's scale 2^-127 and NVFP4's gd may be subnormal; keep them (IEEE).
        out = exact_multiply(values, scale_inv) if self.granularity.fp4 else scaled_product(values, scale_inv)
        if self.global_amax is not None:
            out = exact_multiply(out, nvfp4_global_scales(self.global_amax)[1])
        return out.reshape(shape).astype(dtype)

    def _unpacked_shape(self) -> tuple[int, ...]:
        if not self.granularity.fp4:
            return tuple(self.data.shape)
        if self.axis == 0:
            return self.unpacked_shape_2d
        return (*self.data.shape[:-1], 2 * self.data.shape[-1])


# granularity, axis and power_2_scales are static (pytree metadata), data and scale_inv leaves.
jax.tree_util.register_dataclass(
    QuantizedArray,
    data_fields=["data", "scale_inv", "global_amax"],
    meta_fields=["granularity", "axis", "power_2_scales"],
)


def _check_arguments(x, rule: QuantRule, axis, scale) -> int:
    """Validate :func:`quantize`'s arguments (``x`` and ``scale`` already arrays); return the
    normalized axis."""
    check_type("rule", rule, QuantRule, "a QuantRule (fp8train.spec.QuantRule)")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"quantize takes float32, bfloat16 or float16 input, got {x.dtype}")
    axis = rule.check_input(tuple(x.shape), axis, scale_given=scale is not None, noun="array")
    if scale is not None and (scale.size != 1 or not jnp.issubdtype(scale.dtype, jnp.floating)):
        raise ValueError(f"scale must be a one-element floating-point array, got shape {tuple(scale.shape)} of {scale.dtype}")
    return axis


def quantize(
    x: jax.Array,
    rule: QuantRule,
    *,
    axis: int = -1,
    scale: jax.Array | None = None,
    amax_axis_name: str | tuple[str, ...] | None = None,
    key: jax.Array | None = None,
) -> QuantizedArray:
    """Quantize ``x`` by ``rule``, one scale per scaling group: FP8 (``NUMERICS.md``
    sections 2-3) or 4-bit E2M1 (section 6: NVFP4, MXFP4, the Hadamard transform, stochastic
    rounding), bit-identical to :func:`fp8train.quant.quantize.quantize` on the same values
    (data codes and scales; an FP8 NaN's code is NaN, its sign unspecified; stochastic
    rounding draws from a JAX key, not PyTorch's generator). Works under ``jax.jit``
    (``rule`` is static).

    Args:
        x: float32, bfloat16 or float16 array. Ranks > 2 behave as their 2-D view
            ``(prod(leading dims), last dim)``.
        rule: the granularity, format and scale rule (:class:`~fp8train.spec.rule.QuantRule`).
        axis: -1 puts the scaling groups along the last dim (rowwise usage), 0 along the
            first (columnwise usage). Ignored by ``tensor``, ``block128x128``, ``nvfp4_2d``.
        scale: a precomputed float32 scale (per-tensor rules only, e.g. delayed scaling).
        amax_axis_name: inside ``shard_map``: the mesh axis (or axes) whose shards make up
            the tensor; a per-tensor amax (and NVFP4's global amax) is the MAX over them
            (``jax.lax.pmax``) before the scales are computed. Under ``jax.jit`` with sharded
            arrays no name is needed: the amax is already global.
        key: a JAX PRNG key, required by ``rule.stochastic_rounding`` (one uniform float32
            draw per element of the 2-D view, in row-major order: :mod:`fp8train.jax.e2m1`);
            the same key gives the same codes. Unused otherwise.

    Returns:
        A :class:`QuantizedArray`: ``data`` of ``x``'s shape (FP8), or packed (4-bit).

    Raises:
        ValueError: an unsupported input dtype or axis, a shape the granularity cannot
            tile, a scale with a rule that is not per-tensor, stochastic rounding without a key.
        TypeError: ``x`` not an array, ``rule`` not a QuantRule, ``axis`` not an int.
    """
    x = check_array("x", x)
    if scale is not None:
        scale = check_array("scale", scale)
    axis = _check_arguments(x, rule, axis, scale)
    if not rule.granularity.fp4:
        return _quantize_fp8(x, rule, axis, scale, amax_axis_name)
    if rule.stochastic_rounding and key is None:
        raise ValueError(
            "stochastic_rounding=True draws from a JAX PRNG key: pass key=jax.random.key(seed) "
            "(split or fold in the step for each call), or stochastic_rounding=False"
        )
    data, scale_inv, global_amax = quantize_fp4(x, rule, axis, key, amax_axis_name)
    return QuantizedArray(
        data=data,
        scale_inv=scale_inv,
        granularity=rule.granularity,
        axis=axis,
        power_2_scales=rule.granularity.always_power_2,
        global_amax=global_amax,
    )


def _quantize_fp8(x: jax.Array, rule: QuantRule, axis: int, scale, amax_axis_name) -> QuantizedArray:
    """:func:`quantize` for an FP8 rule (arguments checked)."""
    granularity = rule.granularity
    m, k = view_2d_shape(tuple(x.shape))
    rows, cols = granularity.group_shape(axis, (m, k))
    groups = to_float32(x).reshape(m // rows if rows else 1, rows, k // cols if cols else 1, cols)
    if scale is not None:
        group_scale = scale.astype(jnp.float32).reshape(1, 1, 1, 1)
        scale_inv = reciprocal(group_scale)
    else:
        group_scale, scale_inv = _group_scales(_group_amax(groups, rule, amax_axis_name), rule, x.dtype)
    data = cast_to_fp8(scaled_product(groups, group_scale), jax_dtype(rule.format))
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
        power_2_scales=granularity.always_power_2 or (rule.power_2_scales and scale is None),
    )


def _group_amax(groups: jax.Array, rule: QuantRule, amax_axis_name) -> jax.Array:
    """``max |x|`` per group of a ``(row groups, rows, col groups, cols)`` float32 view
    (NaN wins, subnormals count), MAX-reduced over ``amax_axis_name`` for a per-tensor rule."""
    amax_bits = jnp.max(magnitude_bits(groups), axis=(1, 3), keepdims=True, initial=0)
    if amax_axis_name is not None and rule.granularity.per_tensor:
        amax_bits = lax.pmax(amax_bits, amax_axis_name)
    return from_bits(amax_bits)


def _group_scales(amax, rule: QuantRule, x_dtype):
    """``(scale, scale_inv)`` of every group; E8M0 ``scale_inv`` as its uint8 exponent."""
    granularity = rule.granularity
    if granularity.e8m0_scales:
        if rule.amax_epsilon > 0:
            amax = _raise_to_epsilon(amax, rule.amax_epsilon)
        exponent = mx_scale_exponent(amax, rule.fp8_max, rule.mx_scale_rule)
        scale = exp2_int(127 - exponent.astype(jnp.int32))
        # A NaN anywhere in a block makes the whole block NaN.
        scale = jnp.where(exponent == 0xFF, np.float32(np.nan), scale)
        return scale, exponent
    # Block scales that overflow take the input dtype's largest value (NUMERICS.md).
    inf_scale_value = float(jnp.finfo(x_dtype).max) if granularity.block else FLOAT32_MAX
    scale = amax_to_scale(
        amax,
        rule.fp8_max,
        power_2_scales=rule.power_2_scales,
        amax_epsilon=rule.amax_epsilon,
        inf_scale_value=inf_scale_value,
    )
    return scale, reciprocal(scale)


def _raise_to_epsilon(amax: jax.Array, amax_epsilon: float) -> jax.Array:
    """``amax`` raised to ``amax_epsilon`` where below it (compared on bits: subnormals count)."""
    epsilon_bits = int(np.array(amax_epsilon, np.float32).view(np.int32))
    return jnp.where(magnitude_bits(amax) < epsilon_bits, np.float32(amax_epsilon), amax)


def transpose(qa: QuantizedArray) -> QuantizedArray:
    """The transpose of a 2-D-viewed :class:`QuantizedArray`: data ``[A, B]`` becomes
    ``[B, A]`` and the scales follow, so a tensor quantized along its first dim (``axis=0``)
    becomes a K-last GEMM operand and vice versa. ``tensor``, ``block128x128`` and ``nvfp4_2d``
    keep their axis (one scale, or square tiles that transpose with the data). 4-bit data is
    packed along its scaling axis, which the byte transpose carries along; ``nvfp4_2d``'s,
    always along the last dim, is unpacked and packed again along the new last dim."""
    granularity = qa.granularity
    data = qa.data.reshape(view_2d_shape(tuple(qa.data.shape))).T
    if granularity.fp4 and granularity.symmetric:
        data = pack_e2m1(unpack_e2m1(data, 0), -1)  # 16x16 tiles pack along the last dim
    scale_inv = qa.scale_inv if qa.scale_inv.ndim == 0 else qa.scale_inv.T
    axis = qa.axis if granularity.symmetric else (0 if qa.axis == -1 else -1)
    return QuantizedArray(
        data=data,
        scale_inv=scale_inv,
        granularity=granularity,
        axis=axis,
        power_2_scales=qa.power_2_scales,
        global_amax=qa.global_amax,
    )
