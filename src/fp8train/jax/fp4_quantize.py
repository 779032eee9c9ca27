"""4-bit quantization in JAX (NUMERICS.md 6), the twin of :mod:`fp8train.quant.fp4_quantize`:
NVFP4 (1x16 groups or 16x16 tiles, E4M3 block scales under a float32 global scale) and
MXFP4 (1x32 groups, E8M0 scales), E2M1 data packed two codes a byte along the scaling axis.

Layouts for an input whose 2-D view is ``[M, K]`` (as :func:`fp8train.quant.quantize`):

============  ==================================  ==================================
              ``axis=-1`` (rowwise)                ``axis=0`` (columnwise)
============  ==================================  ==================================
data (uint8)  ``[..., K/2]`` (leading dims kept)   ``[M/2, K]`` (the 2-D view)
nvfp4         scales ``[M, K/16]`` E4M3            ``[M/16, K]`` E4M3
nvfp4_2d      scales ``[M/16, K/16]`` E4M3, data ``[..., K/2]`` (always axis -1)
mxfp4         scales ``[M, K/32]`` E8M0            ``[M/32, K]`` E8M0
============  ==================================  ==================================

Every product whose operand or result may be a float32 subnormal is the IEEE one
(:mod:`fp8train.jax.ieee`), so the codes and scales are PyTorch's bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..spec.granularities import view_2d_shape
from ..spec.rule import QuantRule
from .cast import FLOAT32_MAX, cast_to_fp8, exp2_int, from_bits, magnitude_bits, reciprocal, scaled_product, to_float32
from .e2m1 import cast_to_e2m1, pack_e2m1
from .hadamard import random_hadamard_transform
from .ieee import exact_multiply, exact_reciprocal
from .scaling import mx_scale_exponent

__all__ = ["NVFP4_GLOBAL_RANGE", "nvfp4_global_scales", "nvfp4_block_scales", "quantize_fp4"]

NVFP4_GLOBAL_RANGE = 2688.0
"""``448 * 6``: E4M3's largest block scale times E2M1's largest value."""

_E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
_ONE_SIXTH = np.float32(1.0 / 6.0)


def nvfp4_global_scales(global_amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(ge, gd)``: ``ge = min(2688 / global_amax, FLT_MAX)`` (1 where that is 0: an
    infinite amax), ``gd = 1 / ge``; NaN propagates. ``ge`` is normal for every amax (a
    subnormal or zero amax gives FLT_MAX both here and in IEEE arithmetic); ``gd`` may be
    subnormal, and is kept (:func:`~fp8train.jax.cast.reciprocal`)."""
    global_amax = global_amax.astype(jnp.float32)
    ge = jnp.minimum(np.float32(NVFP4_GLOBAL_RANGE) / global_amax, np.float32(FLOAT32_MAX))
    ge = jnp.where(ge == 0, np.float32(1), ge)
    return ge, reciprocal(ge)


def nvfp4_block_scales(group_amax: jax.Array, global_amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4's per-block ``(dec, enc)``, float32 arithmetic as IEEE gives it::

        m   = ge * float32(1/6)
        dec = e4m3(clamp(min(group_amax * m, FLT_MAX), -448, 448))     (RNE cast to E4M3)
        enc = min(1 / (float32(dec) * gd), FLT_MAX)

    Returns ``dec`` as ``float8_e4m3fn`` and ``enc`` as float32, of ``group_amax``'s shape.
    """
    ge, gd = nvfp4_global_scales(global_amax)
    m = ge * _ONE_SIXTH
    largest = np.float32(FLOAT32_MAX)
    # A subnormal group amax counts; a subnormal product casts to E4M3 zero either way.
    scaled = jnp.clip(jnp.minimum(scaled_product(group_amax, m), largest), -448.0, 448.0)
    dec = cast_to_fp8(scaled, jnp.float8_e4m3fn)
    enc = jnp.minimum(exact_reciprocal(exact_multiply(dec.astype(jnp.float32), gd)), largest)
    return dec, enc


def _mx_scales(group_amax: jax.Array, rule: QuantRule) -> tuple[jax.Array, jax.Array]:
    """MXFP4's ``(E8M0 scale_inv, enc)``: the MXFP8 rule with 6 for 448."""
    exponent = mx_scale_exponent(group_amax, rule.fp8_max, rule.mx_scale_rule)
    enc = exp2_int(127 - exponent.astype(jnp.int32))
    # A NaN block's scale is NaN (0xFF); its values become code 0 (E2M1 has no NaN).
    enc = jnp.where(exponent == 0xFF, np.float32(np.nan), enc)
    return lax.bitcast_convert_type(exponent, _E8M0), enc


def _max_bits(x32: jax.Array, axis, amax_axis_name=None) -> jax.Array:
    bits = jnp.max(magnitude_bits(x32), axis=axis, keepdims=axis is not None, initial=0)
    if amax_axis_name is not None:
        bits = lax.pmax(bits, amax_axis_name)
    return from_bits(bits)


def quantize_fp4(
    x: jax.Array, rule: QuantRule, axis: int, key: jax.Array | None = None, amax_axis_name=None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``x`` (checked; ``axis`` normalized) in 4 bits by ``rule``: the transform
    (``rule.rht``), the scales, the E2M1 cast (stochastic with ``rule.stochastic_rounding``,
    from ``key``), the packing. ``amax_axis_name``: NVFP4's global amax is the MAX over
    that mesh axis (``shard_map``), so every shard quantizes alike.

    Returns:
        ``(data, scale_inv, global_amax)`` in the module's layouts; ``global_amax`` the
        float32 scalar for NVFP4, ``None`` for MXFP4.
    """
    granularity = rule.granularity
    if rule.rht:
        x = random_hadamard_transform(x, axis)
    m, k = view_2d_shape(tuple(x.shape))
    rows, cols = granularity.group_shape(axis, (m, k))
    x32 = to_float32(x).reshape(m, k)
    groups = x32.reshape(m // rows, rows, k // cols, cols)
    group_amax = _max_bits(groups, (1, 3))
    global_amax = None
    if granularity.two_level_scales:
        global_amax = _max_bits(x32, None, amax_axis_name)
        scale_inv, enc = nvfp4_block_scales(group_amax, global_amax)
    else:
        scale_inv, enc = _mx_scales(group_amax, rule)
    # [M, K]: stochastic rounding draws one uniform per element of the 2-D view, row-major.
    scaled = exact_multiply(groups, enc).reshape(m, k)
    data = pack_e2m1(cast_to_e2m1(scaled, key=key if rule.stochastic_rounding else None), axis)
    if axis == -1:
        data = data.reshape(*x.shape[:-1], k // 2)
    return data, scale_inv.reshape(m // rows, k // cols), global_amax
