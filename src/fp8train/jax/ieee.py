"""IEEE float32 products, sums and reciprocals where XLA's CPU backend flushes subnormals.

XLA on CPU reads a subnormal operand as zero and flushes a subnormal result to a signed
zero (:mod:`fp8train.jax.cast`). The 4-bit path needs the IEEE results there: NVFP4's
``1 / (dec * gd)`` with a subnormal product, the sign of ``x * enc`` that is a negative
subnormal (E2M1 code 8, not 0), the random Hadamard transform of subnormal inputs. These
functions compute them from the bits, in integer arithmetic where a float op would flush.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .cast import float32_bits, from_bits, reciprocal

__all__ = ["is_subnormal", "exact_multiply", "exact_add", "exact_divide", "exact_reciprocal", "is_negative"]

_MAGNITUDE_MASK = 0x7FFFFFFF
_EXPONENT_MASK = 0x7F800000
_MANTISSA_MASK = 0x007FFFFF
_SIGN = np.int32(-0x80000000)
_TWO_POW_64 = np.float32(2.0**64)
_TWO_POW_MINUS_64 = np.float32(2.0**-64)
_TWO_POW_MINUS_85 = np.float32(2.0**-85)
_TWO_POW_85 = np.float32(2.0**85)
_TWO_POW_126 = np.float32(2.0**126)
_TWO_POW_23 = np.float32(2.0**23)
_SMALL_BITS = 0x1D800000  # 2^-60: below it, a sum is taken times 2^64


def is_subnormal(x32: jax.Array) -> jax.Array:
    """Whether float32 ``x32`` is subnormal (from its bits: no comparison XLA would flush)."""
    bits = float32_bits(x32)
    return ((bits & _EXPONENT_MASK) == 0) & ((bits & _MANTISSA_MASK) != 0)


def is_negative(x32: jax.Array) -> jax.Array:
    """``x32 < 0`` in IEEE arithmetic (negative subnormals included; ``-0.0`` and NaN not)."""
    bits = float32_bits(x32)
    magnitude = bits & _MAGNITUDE_MASK
    return (bits < 0) & (magnitude != 0) & (magnitude <= _EXPONENT_MASK)


def _significand(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(S, e)`` with ``|x| = S * 2^(e - 23)`` and ``S`` in ``[2^23, 2^24)``, for a finite
    non-zero float32 of ``bits`` (subnormals normalized by their leading bit)."""
    magnitude = bits & _MAGNITUDE_MASK
    biased = magnitude >> 23
    mantissa = magnitude & _MANTISSA_MASK
    top = 31 - lax.clz(jnp.maximum(mantissa, 1))  # a subnormal's leading bit
    sub_significand = jnp.left_shift(mantissa, jnp.clip(23 - top, 0, 23))
    significand = jnp.where(biased > 0, mantissa | 0x800000, sub_significand)
    exponent = jnp.where(biased > 0, biased - 127, top - 149)
    return significand, exponent


def _product_limbs(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a * b`` of two 24-bit integers as ``(H, L)``: ``H * 2^24 + L``, ``L < 2^24``
    (12-bit limbs, so every partial product fits int32)."""
    a1, a0, b1, b0 = a >> 12, a & 0xFFF, b >> 12, b & 0xFFF
    middle = a1 * b0 + a0 * b1
    low = a0 * b0 + ((middle & 0xFFF) << 12)
    high = a1 * b1 + (middle >> 12) + (low >> 24)
    return high, low & 0xFFFFFF


def _round_shifted(high: jax.Array, low: jax.Array, shift: jax.Array) -> jax.Array:
    """``(high * 2^24 + low) / 2^shift`` rounded to the nearest integer, ties to even, for
    ``shift >= 24`` (0 from 50 on: the value is below 2^48)."""
    h = jnp.clip(shift - 24, 0, 30)
    quotient = jnp.right_shift(high, h)
    remainder = high & (jnp.left_shift(1, h) - 1)
    half = jnp.left_shift(1, jnp.maximum(h - 1, 0))
    above = jnp.where(h == 0, low > 0x800000, (remainder > half) | ((remainder == half) & (low > 0)))
    tie = jnp.where(h == 0, low == 0x800000, (remainder == half) & (low == 0))
    rounded = quotient + (above | (tie & ((quotient & 1) == 1))).astype(jnp.int32)
    return jnp.where(shift >= 50, 0, rounded)


def exact_multiply(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b`` of float32 arrays (broadcasting) rounded once to float32 as IEEE arithmetic
    with subnormals gives it: subnormal operands count, subnormal results are rounded to
    nearest even on their grid, not flushed.

    The product of the two 24-bit significands is exact in 12-bit limbs; a normal result
    is the float32 product of the significands (one rounding) moved to its exponent, a
    subnormal one the limbs rounded on the subnormal grid.
    """
    a, b = jnp.broadcast_arrays(a.astype(jnp.float32), b.astype(jnp.float32))
    a_bits, b_bits = float32_bits(a), float32_bits(b)
    sign = (a_bits ^ b_bits) & _SIGN
    a_sig, a_exp = _significand(a_bits)
    b_sig, b_exp = _significand(b_bits)
    high, low = _product_limbs(a_sig, b_sig)
    exponent = a_exp + b_exp - 46  # |a b| = (high 2^24 + low) * 2^exponent
    top = 46 + (high >> 23)
    # Normal: the significands' float32 product (exact rounding to 24 bits), exponent moved.
    p_bits = float32_bits(a_sig.astype(jnp.float32) * b_sig.astype(jnp.float32))
    biased = (p_bits >> 23) + exponent
    normal_bits = jnp.where(biased >= 255, _EXPONENT_MASK, (p_bits & _MANTISSA_MASK) | (jnp.clip(biased, 1, 254) << 23))
    subnormal_bits = _round_shifted(high, low, -149 - exponent)
    finite = jnp.where(top + exponent >= -126, normal_bits, subnormal_bits) | sign
    # Zeros, infinities and NaNs: the plain product, a subnormal operand counted as non-zero.
    special = lambda x, bits: jnp.where(is_subnormal(x), jnp.where(bits < 0, np.float32(-1), np.float32(1)), x)
    plain = special(a, a_bits) * special(b, b_bits)
    ordinary = lambda bits: ((bits & _MAGNITUDE_MASK) != 0) & ((bits & _EXPONENT_MASK) != _EXPONENT_MASK)
    return jnp.where(ordinary(a_bits) & ordinary(b_bits), from_bits(finite), plain)


def _unscale(y: jax.Array) -> jax.Array:
    """``y * 2^-64`` rounded as IEEE arithmetic does (subnormal results on their grid)."""
    bits = float32_bits(y)
    magnitude = bits & _MAGNITUDE_MASK
    small = magnitude < 0x20800000  # |y| < 2^-62: the result is subnormal
    units = jnp.round(jnp.abs(jnp.where(small, y, 0)) * _TWO_POW_85).astype(jnp.int32)  # ties to even
    subnormal = from_bits(units | (bits & _SIGN))
    return jnp.where(small, subnormal, y * _TWO_POW_MINUS_64)


def _times_2_pow_64(x: jax.Array) -> jax.Array:
    """``x * 2^64`` exactly for ``|x| < 2^63`` (subnormals from their mantissa bits)."""
    bits = float32_bits(x)
    mantissa = (bits & _MANTISSA_MASK).astype(jnp.float32) * _TWO_POW_MINUS_85
    sub = jnp.where(bits < 0, -mantissa, mantissa)
    return jnp.where(is_subnormal(x), sub, x * _TWO_POW_64)


def exact_add(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a + b`` of float32 arrays as IEEE arithmetic with subnormals gives it.

    Where both are below 2^-60 the sum is taken times 2^64 (exact scaling; a subnormal
    IEEE sum is exact, so it is exact scaled too) and scaled back with IEEE rounding. Where
    one is larger, a subnormal other is far below half its ulp and the plain sum is right.
    """
    a, b = jnp.broadcast_arrays(a.astype(jnp.float32), b.astype(jnp.float32))
    small = ((float32_bits(a) & _MAGNITUDE_MASK) < _SMALL_BITS) & ((float32_bits(b) & _MAGNITUDE_MASK) < _SMALL_BITS)
    scaled = _times_2_pow_64(jnp.where(small, a, 0)) + _times_2_pow_64(jnp.where(small, b, 0))
    # A select between the sum and its scaled twin: no multiply-add for XLA to fuse.
    return jnp.where(small, _unscale(scaled), a + b)


def exact_reciprocal(x: jax.Array) -> jax.Array:
    """``1 / x`` in float32 as IEEE arithmetic gives it, for a subnormal ``x`` too
    (``2^149 / mantissa``: ``2^126 / mantissa`` is normal and correctly rounded, and the
    exact factor 2^23 keeps that rounding or overflows to inf as IEEE does)."""
    x = x.astype(jnp.float32)
    bits = float32_bits(x)
    mantissa = jnp.maximum(bits & _MANTISSA_MASK, 1).astype(jnp.float32)
    sub = (_TWO_POW_126 / mantissa) * _TWO_POW_23
    return jnp.where(is_subnormal(x), jnp.where(bits < 0, -sub, sub), reciprocal(x))


def exact_divide(x: jax.Array, divisor: float) -> jax.Array:
    """``x / divisor`` in float32 as IEEE arithmetic gives it, for a positive constant
    ``divisor`` whose odd part is below 512 (NVFP4's ``7225344 = 441 * 2^14``).

    A true division: XLA turns a division by a broadcast scalar into a multiplication by
    its rounded reciprocal (an ulp off at times), so the divisor is a full array behind a
    barrier. A subnormal quotient, which XLA flushes, is the integer
    nearest (ties to even) to ``x / divisor / 2^-149``, from ``x``'s significand in uint32.
    """
    odd, twos = int(divisor), 0
    while odd % 2 == 0:
        odd, twos = odd // 2, twos + 1
    if odd != divisor / 2**twos or odd >= 512:
        raise ValueError(f"divisor={divisor!r} must be an integer whose odd part is below 512")
    x = x.astype(jnp.float32)
    bits = float32_bits(x)
    quotient = x / lax.optimization_barrier(jnp.full(x.shape, divisor, jnp.float32))
    # |x| below divisor * 2^-126: the quotient is subnormal (or zero).
    threshold = int(np.array(divisor * 2.0**-126, np.float32).view(np.int32))
    significand, exponent = _significand(bits)
    shift = exponent + 126 - twos  # x / divisor / 2^-149 = significand * 2^shift / odd
    numerator = jnp.left_shift(significand.astype(jnp.uint32), jnp.clip(shift, 0, 8).astype(jnp.uint32))
    denominator = jnp.left_shift(jnp.uint32(odd), jnp.clip(-shift, 0, 22).astype(jnp.uint32))
    whole = numerator // denominator
    remainder = numerator - whole * denominator
    up = (remainder > denominator - remainder) | ((remainder == denominator - remainder) & ((whole & 1) == 1))
    units = jnp.where(-shift > 22, 0, (whole + up.astype(jnp.uint32)).astype(jnp.int32))
    subnormal = from_bits(units | (bits & _SIGN))
    return jnp.where((bits & _MAGNITUDE_MASK) < threshold, subnormal, quotient)
