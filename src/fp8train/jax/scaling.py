"""From amax to scale in JAX: the per-tensor/row/block rule, the E8M0 exponent of MXFP8,
and delayed scaling's history update. The same rules as :mod:`fp8train.quant.scaling`
(``NUMERICS.md`` section 2), computed on float32 bits wherever XLA's flushing of
subnormals would change a result (:mod:`fp8train.jax.cast`).

The scale convention::

    data = cast_to_fp8(x * scale)        x ~= data * scale_inv,   scale_inv = 1 / scale
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Callable, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..spec.checks import check_int, check_number
from .cast import FLOAT32_MAX, exp2_int, float32_bits, from_bits

__all__ = ["amax_to_scale", "mx_scale_exponent", "e8m0_to_float32", "delayed_scaling_update", "floor_to_power_of_2"]

_EXPONENT_MASK = 0x7F800000
_MANTISSA_MASK = 0x007FFFFF
_INF_BITS = 0x7F800000


def _bits_of(value: float) -> int:
    return int(np.array(value, np.float32).view(np.int32))


def floor_to_power_of_2(scale: jax.Array) -> jax.Array:
    """Zero the mantissa bits of float32 ``scale``, keeping sign and exponent."""
    return from_bits(float32_bits(scale.astype(jnp.float32)) & -0x800000)


def amax_to_scale(
    amax: jax.Array,
    fp8_max: float,
    *,
    power_2_scales: bool = False,
    amax_epsilon: float = 0.0,
    inf_scale_value: float = FLOAT32_MAX,
) -> jax.Array:
    """The float32 scale(s) that map ``amax`` onto ``fp8_max``, elementwise::

        amax = max(amax, amax_epsilon)
        scale = 1                       if amax == 0, inf or NaN
        scale = fp8_max / amax          otherwise (float32)
        scale = inf_scale_value         if that overflowed to inf
        scale = 2**floor(log2(scale))   if power_2_scales

    A subnormal amax counts as non-zero (its scale overflows to ``inf_scale_value``), as
    in IEEE arithmetic, although XLA's CPU backend reads it as zero.

    Args:
        amax: non-negative (or NaN) float32 array of any shape.
        fp8_max: largest finite value of the target format.
        power_2_scales: round every scale down to a power of two.
        amax_epsilon: lower bound applied to ``amax`` first.
        inf_scale_value: replacement for a scale that overflows.

    Returns:
        float32 array of the shape of ``amax``.
    """
    check_number("fp8_max", fp8_max, minimum=0, exclusive=True)
    check_number("amax_epsilon", amax_epsilon, minimum=0)
    amax = amax.astype(jnp.float32)
    bits = float32_bits(amax) & 0x7FFFFFFF
    if amax_epsilon > 0:
        epsilon_bits = _bits_of(amax_epsilon)
        amax = jnp.where(bits < epsilon_bits, np.float32(amax_epsilon), amax)
        bits = jnp.where(bits < epsilon_bits, epsilon_bits, bits)
    # A subnormal amax reads as 0 here, so the quotient is inf, as IEEE's is.
    scale = np.float32(fp8_max) / amax
    scale = jnp.where(jnp.isinf(scale), np.float32(inf_scale_value), scale)
    usable = (bits != 0) & (bits < _INF_BITS)
    scale = jnp.where(usable, scale, np.float32(1.0))
    return floor_to_power_of_2(scale) if power_2_scales else scale


@functools.cache
def _smallest_float32_with_product_above(r: float, bound: Fraction, inclusive: bool) -> int:
    """Bits of the smallest non-negative float32 ``a`` whose exact product ``a * r``
    exceeds (or, ``inclusive``, reaches) ``bound``."""
    r_exact = Fraction(float(np.float32(r)))
    low, high = 0, _INF_BITS  # search the bit patterns: order is value order
    while low < high:
        middle = (low + high) // 2
        product = Fraction(float(np.array(middle, np.int32).view(np.float32))) * r_exact
        if product > bound or (inclusive and product == bound):
            high = middle
        else:
            low = middle + 1
    return low


def mx_scale_exponent(amax: jax.Array, fp8_max: float, rule: str = "ceil") -> jax.Array:
    """Biased E8M0 exponent ``e`` of each MXFP8 block, as uint8 (``scale_inv = 2**(e-127)``).

    ``"ceil"`` (default)::

        t = amax * float32(1 / fp8_max)           (multiply by the reciprocal)
        e = exponent bits of t, + 1 if t's mantissa bits are non-zero
        a float32-subnormal t: e = 0 if t <= 2^-127, else 1
        NaN -> 0xFF, inf -> 0xFE, t == 0 -> 0

    ``"ocp"``: ``e = floor(log2(amax)) - emax + 127`` clamped to ``[0, 254]``.

    Where ``t`` would be a float32 subnormal (which XLA flushes) the exponent comes from
    thresholds on ``amax`` computed exactly, in rational arithmetic, for this ``fp8_max``.

    Args:
        amax: float32 array of block amaxes (non-negative or NaN).
        fp8_max: largest finite value of the data format.
        rule: ``"ceil"`` or ``"ocp"``.

    Returns:
        uint8 array of the shape of ``amax``.
    """
    amax = amax.astype(jnp.float32)
    amax_bits = float32_bits(amax) & 0x7FFFFFFF
    if rule == "ceil":
        reciprocal = float(np.float32(1.0 / fp8_max))
        t_bits = float32_bits(amax * np.float32(reciprocal))
        exponent = (t_bits & _EXPONENT_MASK) >> 23
        exponent = exponent + ((t_bits & _MANTISSA_MASK) != 0).astype(jnp.int32)
        # t (IEEE) is subnormal or zero below these amaxes: e is 0 up to t <= 2^-127, then 1.
        above_half = _smallest_float32_with_product_above(reciprocal, Fraction(2) ** -127 + Fraction(2) ** -150, False)
        normal = _smallest_float32_with_product_above(reciprocal, Fraction(2) ** -126, True)
        exponent = jnp.where(amax_bits < normal, (amax_bits >= above_half).astype(jnp.int32), exponent)
    elif rule == "ocp":
        emax = (_bits_of(fp8_max) >> 23) - 127
        biased = amax_bits >> 23
        mantissa = amax_bits & _MANTISSA_MASK
        # floor(log2) of a subnormal amax: the position of its top mantissa bit.
        floor_log2 = jnp.where(biased > 0, biased - 127, (31 - jax.lax.clz(mantissa)) - 149)
        exponent = jnp.clip(floor_log2 - emax + 127, 0, 254)
        exponent = jnp.where(amax_bits == 0, 0, exponent)
    else:
        raise ValueError(f"rule={rule!r} must be 'ceil' or 'ocp'")
    exponent = jnp.where(amax_bits == _INF_BITS, 0xFE, exponent)
    exponent = jnp.where(amax_bits > _INF_BITS, 0xFF, exponent)
    return exponent.astype(jnp.uint8)


def e8m0_to_float32(scale_inv: jax.Array) -> jax.Array:
    """Decode E8M0 scales (``float8_e8m0fnu`` or their uint8 bits) to float32, from bits:
    ``2**(e - 127)``, 0xFF -> NaN."""
    if scale_inv.dtype != jnp.uint8:
        scale_inv = jax.lax.bitcast_convert_type(scale_inv, jnp.uint8)
    exponent = scale_inv.astype(jnp.int32)
    return jnp.where(exponent == 0xFF, np.float32(np.nan), exp2_int(exponent - 127))


def delayed_scaling_update(
    amax_history: jax.Array,
    scale: jax.Array,
    fp8_max: Union[float, jax.Array],
    *,
    margin: int = 0,
    algo: Union[str, Callable[[jax.Array], jax.Array]] = "max",
) -> tuple[jax.Array, jax.Array]:
    """Delayed scaling's update after a step, functionally: ``(new_amax_history, new_scale)``.

    ``amax_history[0]`` holds the amax recorded during the step. For every tensor whose
    current amax is non-zero::

        amax = max(amax_history)  ("max") | amax_history[0]  ("most_recent") | algo(amax_history)
        scale = (fp8_max / amax) / 2**margin   if amax is finite and > 0, else unchanged
        (an infinite scale becomes the largest finite float32)
        amax_history = roll(amax_history, -1);  amax_history[0] = 0

    A tensor whose current amax is 0 (it did not run) is neither rescaled nor rolled. The
    same rule as :func:`fp8train.quant.delayed_scaling_update`, which updates in place.

    Args:
        amax_history: float32 ``(L, *S)``.
        scale: float32 ``S``.
        fp8_max: largest finite value of each tensor's format, broadcastable to ``S``.
        margin: the scale is divided by ``2**margin``.
        algo: ``"max"``, ``"most_recent"``, or a callable mapping ``amax_history`` to ``S``.

    Raises:
        ValueError: mismatched shapes or an unknown ``algo``.
    """
    check_int("margin", margin, minimum=0)
    if amax_history.ndim < 1 or amax_history.shape[1:] != scale.shape:
        raise ValueError(
            f"amax_history of shape {tuple(amax_history.shape)} does not match scale of shape "
            f"{tuple(scale.shape)}; expected amax_history.shape == (L, *scale.shape)"
        )
    if algo == "max":
        # On magnitude bits: NaN wins, subnormals count (as jnp.max would not on CPU).
        amax = from_bits(jnp.max(float32_bits(amax_history) & 0x7FFFFFFF, axis=0))
    elif algo == "most_recent":
        amax = amax_history[0]
    elif callable(algo):
        amax = jnp.asarray(algo(amax_history)).astype(jnp.float32)
    else:
        raise ValueError(f"algo={algo!r} must be 'max', 'most_recent' or a callable")
    amax_bits = float32_bits(amax) & 0x7FFFFFFF
    ran = (float32_bits(amax_history[0]) & 0x7FFFFFFF) != 0
    new_scale = (jnp.asarray(fp8_max, jnp.float32) / amax) / np.float32(2.0**margin)
    new_scale = jnp.where(jnp.isinf(new_scale), np.float32(FLOAT32_MAX), new_scale)
    usable = ran & (amax_bits != 0) & (amax_bits < _INF_BITS) & (float32_bits(amax) >= 0)
    new_scale = jnp.where(usable, new_scale, scale)
    rolled = jnp.roll(amax_history, -1, axis=0).at[0].set(0.0)
    new_history = jnp.where(ran, rolled, amax_history)
    return new_history, new_scale
