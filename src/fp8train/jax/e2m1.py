"""E2M1 in JAX, the data format of NVFP4 and MXFP4 (NUMERICS.md 6): the cast to codes (round
to nearest even, or stochastic from a JAX key), the codes' values, and the packing of two
codes a byte along one axis: the bytes of PyTorch's ``torch.float4_e2m1fn_x2``, as ``uint8``.

A code is 4 bits: bit 3 the sign, bits 0-2 the magnitude index into
``0, 0.5, 1, 1.5, 2, 3, 4, 6``. The twin of :mod:`fp8train.quant.e2m1`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .ieee import is_negative

__all__ = ["E2M1_VALUES", "cast_to_e2m1", "e2m1_to_float32", "pack_e2m1", "unpack_e2m1"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of codes 0-7 (code | 8 is the negative)."""

# Round to nearest, ties to even: the index is the number of midpoints |v| passes; the
# midpoint above an even index only strictly, the one above an odd index also when equal.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_SIGN_BIT = 8


def _round_to_nearest_even(magnitude: jax.Array) -> jax.Array:
    index = jnp.zeros(magnitude.shape, jnp.int32)
    for i, midpoint in enumerate(_MIDPOINTS):
        passed = magnitude >= midpoint if i % 2 == 1 else magnitude > midpoint
        index = index + passed.astype(jnp.int32)
    return index  # NaN compares false: index 0


def _round_stochastically(magnitude: jax.Array, key: jax.Array) -> jax.Array:
    """``hi`` with probability ``(v - lo) / (hi - lo)``, else ``lo``, for the magnitude ``v``
    (so a negative value moves away from zero with that probability): up where a uniform
    float32 draw ``u`` in ``[0, 1)`` (``jax.random.uniform(key, shape)``, one per value in
    the array's order) is below that probability, which float32 computes exactly (a
    float32-subnormal magnitude, whose probability is below 2^-125, rounds down)."""
    values = jnp.asarray(E2M1_VALUES, jnp.float32)
    lower = jnp.zeros(magnitude.shape, jnp.int32)
    for value in E2M1_VALUES[1:]:
        lower = lower + (magnitude >= value).astype(jnp.int32)
    upper = jnp.minimum(lower + 1, len(E2M1_VALUES) - 1)
    low, high = values[lower], values[upper]
    gap = jnp.where(high > low, high - low, np.float32(1))
    probability = (magnitude - low) / gap
    draw = jax.random.uniform(key, magnitude.shape, jnp.float32)
    return lower + (draw < probability).astype(jnp.int32)  # NaN: never up, code 0


def cast_to_e2m1(v: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
    """The E2M1 codes (uint8, 0-15, one a byte, unpacked) of float32 ``v``, saturating:
    magnitudes above 6 (infinities too) take 6, as ``clamp(v, -6, 6)`` first.

    Round to nearest, ties to even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4),
    or, given a JAX PRNG ``key``, stochastically (see :func:`_round_stochastically`;
    representable values unchanged). ``v < 0`` sets the sign bit, also when it rounds to
    zero (negative subnormals too); ``-0.0`` and NaN give code 0.
    """
    # The sign comes from the bits of v: a clamp or abs could flush a subnormal to zero.
    magnitude = jnp.minimum(jnp.abs(v), np.float32(6))  # NaN stays NaN
    index = _round_to_nearest_even(magnitude) if key is None else _round_stochastically(magnitude, key)
    return (index | is_negative(v).astype(jnp.int32) * _SIGN_BIT).astype(jnp.uint8)


def e2m1_to_float32(codes: jax.Array) -> jax.Array:
    """The float32 values of unpacked E2M1 ``codes`` (uint8, 0-15); code 8 is ``-0.0``."""
    values = jnp.asarray(E2M1_VALUES, jnp.float32)[(codes & 7).astype(jnp.int32)]
    return jnp.where((codes & _SIGN_BIT) != 0, -values, values)


def pack_e2m1(codes: jax.Array, axis: int) -> jax.Array:
    """Two codes a byte along ``axis`` (-1 or 0) of 2-D ``codes`` (even size there):
    element ``2j`` in the low nibble and ``2j + 1`` in the high nibble of byte ``j``.
    Returns ``uint8`` with ``axis`` halved."""
    low, high = (codes[:, 0::2], codes[:, 1::2]) if axis == -1 else (codes[0::2], codes[1::2])
    return (low | (high << 4)).astype(jnp.uint8)


def unpack_e2m1(packed: jax.Array, axis: int) -> jax.Array:
    """The codes (uint8, one a byte) of 2-D ``packed`` bytes: ``axis`` (-1 or 0) doubled."""
    low, high = packed & 0x0F, packed >> 4
    if axis == -1:
        return jnp.stack((low, high), axis=2).reshape(packed.shape[0], -1)
    return jnp.stack((low, high), axis=1).reshape(-1, packed.shape[1])
