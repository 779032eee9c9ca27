"""JAX's side of the formats: dtypes, the saturating cast to FP8, and float32 arithmetic
that stays exact where XLA's CPU backend flushes subnormals.

XLA on CPU runs with denormals-are-zero and flush-to-zero: a float32 subnormal *input* of
an arithmetic op or comparison reads as zero, and a subnormal *result* becomes zero. The
PyTorch frontend keeps subnormals, and ``NUMERICS.md`` is written for IEEE arithmetic, so
every place where a subnormal can change an FP8 code or a scale is computed here on the
float32 *bits* instead: magnitudes and amaxes (:func:`magnitude_bits`), products with a
subnormal operand (:func:`scaled_product`), powers of two (:func:`exp2_int`) and the
reciprocal of a scale (:func:`reciprocal`). A flushed *result* is harmless where it feeds
the FP8 cast: every float32 subnormal casts to a signed zero code anyway. The cast itself
(:func:`cast_to_fp8`) is integer arithmetic on the bits too, independent of how a given
XLA release converts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from ..spec.formats import E4M3, E5M2, E8M0, FloatFormat

__all__ = [
    "FP8_DATA_DTYPES",
    "HIGH_PRECISION_DTYPES",
    "jax_dtype",
    "format_of",
    "check_array",
    "float32_bits",
    "from_bits",
    "magnitude_bits",
    "to_float32",
    "exp2_int",
    "reciprocal",
    "scaled_product",
    "cast_to_fp8",
    "FLOAT32_MAX",
]

_FORMATS = (E4M3, E5M2, E8M0)
_DTYPES_BY_NAME = {fmt.dtype_name: jnp.dtype(getattr(jnp, fmt.dtype_name)) for fmt in _FORMATS}
_FORMATS_BY_DTYPE = {_DTYPES_BY_NAME[fmt.dtype_name]: fmt for fmt in _FORMATS}
FP8_DATA_DTYPES = (_DTYPES_BY_NAME[E4M3.dtype_name], _DTYPES_BY_NAME[E5M2.dtype_name])
HIGH_PRECISION_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
FLOAT32_MAX = float(np.finfo(np.float32).max)

_SIGN = np.int32(-0x80000000)
_EXPONENT_MASK = 0x7F800000
_MANTISSA_MASK = 0x007FFFFF
_MAGNITUDE_MASK = 0x7FFFFFFF
_TWO_POW_64 = np.float32(2.0**64)
_TWO_POW_MINUS_64 = np.float32(2.0**-64)
_TWO_POW_MINUS_85 = np.float32(2.0**-85)  # mantissa bits of a subnormal, times 2^64


def jax_dtype(fmt: FloatFormat) -> jnp.dtype:
    """The JAX dtype of a :class:`~fp8train.spec.formats.FloatFormat` (by ``dtype_name``,
    the name JAX, PyTorch and ``ml_dtypes`` share).

    Raises:
        ValueError: ``fmt`` is not one of E4M3, E5M2, E8M0.
    """
    dtype = _DTYPES_BY_NAME.get(getattr(fmt, "dtype_name", None))
    if dtype is None or _FORMATS_BY_DTYPE[dtype] != fmt:
        raise ValueError(f"{fmt!r} is not an fp8train format; use E4M3, E5M2 or E8M0")
    return dtype


def format_of(dtype) -> FloatFormat:
    """The :class:`~fp8train.spec.formats.FloatFormat` of an FP8 JAX dtype.

    Raises:
        ValueError: ``dtype`` is not ``float8_e4m3fn``, ``float8_e5m2`` or ``float8_e8m0fnu``.
    """
    try:
        return _FORMATS_BY_DTYPE[jnp.dtype(dtype)]
    except (KeyError, TypeError):
        valid = ", ".join(f"jnp.{d}" for d in _FORMATS_BY_DTYPE)
        raise ValueError(f"dtype {dtype} is not an fp8train format; use one of {valid}") from None


def check_array(name: str, value) -> jax.Array:
    """``value`` as a JAX array if it is one (or a NumPy array, converted).

    Raises:
        TypeError: anything else (a list, a torch tensor: convert with ``jnp.asarray``).
    """
    if isinstance(value, (jax.Array, np.ndarray)):
        return jnp.asarray(value)
    from ..spec.checks import ArgumentTypeError

    raise ArgumentTypeError(f"{name} must be a JAX array, got {type(value).__name__}; convert it with jnp.asarray")


def float32_bits(x: jax.Array) -> jax.Array:
    """The bits of float32 ``x`` as int32."""
    return lax.bitcast_convert_type(x, jnp.int32)


def from_bits(bits: jax.Array) -> jax.Array:
    """The float32 whose bits are int32 ``bits``."""
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def magnitude_bits(x32: jax.Array) -> jax.Array:
    """``|x|`` as int32 bits. For non-negative floats integer order is value order (NaN
    above inf), so a max over these is the amax, NaN winning, subnormals kept."""
    return float32_bits(x32) & _MAGNITUDE_MASK


def to_float32(x: jax.Array) -> jax.Array:
    """``x`` (float32, bfloat16 or float16) as float32: exact, subnormals kept (a
    conversion, not arithmetic, so XLA does not flush it)."""
    return x if x.dtype == jnp.float32 else x.astype(jnp.float32)


def exp2_int(exponent: jax.Array) -> jax.Array:
    """Exactly ``2**exponent`` in float32 for integer ``exponent`` in ``[-149, 127]``, built
    from bits (normal and subnormal)."""
    exponent = exponent.astype(jnp.int32)
    normal = from_bits(jnp.maximum(exponent + 127, 1) << 23)
    subnormal = from_bits(jnp.left_shift(jnp.int32(1), jnp.clip(exponent + 149, 0, 22)))
    return jnp.where(exponent >= -126, normal, subnormal)


def _is_subnormal(bits: jax.Array) -> jax.Array:
    return ((bits & _EXPONENT_MASK) == 0) & ((bits & _MANTISSA_MASK) != 0)


def _times_2_pow_64(x32: jax.Array, bits: jax.Array) -> jax.Array:
    """A subnormal ``x32`` times 2^64, exactly, from its mantissa bits (no arithmetic on
    the subnormal itself)."""
    value = (bits & _MANTISSA_MASK).astype(jnp.float32) * _TWO_POW_MINUS_85
    return jnp.where(bits < 0, -value, value)


def scaled_product(x32: jax.Array, scale: jax.Array) -> jax.Array:
    """``x32 * scale`` in float32, rounded once, as IEEE arithmetic with subnormals gives it
    (broadcasting). A subnormal operand (input values, or MXFP8's smallest scale 2^-127) is
    first taken times 2^64 from its bits and the product times 2^-64 after; a result that is
    itself subnormal may come back as a signed zero (its FP8 code is a signed zero anyway)."""
    x_bits, s_bits = float32_bits(x32), float32_bits(scale)
    x_sub, s_sub = _is_subnormal(x_bits), _is_subnormal(s_bits)
    x_n = jnp.where(x_sub, _times_2_pow_64(x32, x_bits), x32)
    s_n = jnp.where(s_sub, _times_2_pow_64(scale, s_bits), scale)
    product = x_n * s_n
    # Either operand normalized: one factor 2^-64; both: two (2^-128 is not a normal float).
    product = jnp.where(x_sub | s_sub, product * _TWO_POW_MINUS_64, product)
    return jnp.where(x_sub & s_sub, product * _TWO_POW_MINUS_64, product)


def reciprocal(scale: jax.Array) -> jax.Array:
    """``1 / scale`` in float32, correctly rounded, subnormal results included.

    For ``scale <= 2^126`` the quotient is normal and XLA's division is exact IEEE. Above,
    it is a subnormal, which XLA would flush: its mantissa is the integer nearest (ties to
    even) to ``2^n / M`` (``n = 299 - E``, ``E`` the biased exponent and ``M`` the 24-bit
    significand of ``scale``). A float32 quotient is within 0.25 of it; the remainder
    ``2^n - q * M`` is small, so int32 arithmetic that wraps modulo 2^32 gives it exactly,
    and it says which way to round.
    """
    scale = scale.astype(jnp.float32)
    bits = float32_bits(scale)
    biased = (bits >> 23) & 0xFF
    significand = (bits & _MANTISSA_MASK) | 0x800000
    num_bits = 299 - jnp.clip(biased, 253, 254)  # 45 or 46
    quotient = exp2_int(num_bits) / significand.astype(jnp.float32)
    nearest = jnp.floor(quotient + np.float32(0.5)).astype(jnp.int32)
    # 2^num_bits is 0 modulo 2^32, and |remainder| < 2^25: the wrapped product is exact.
    twice_remainder = -(nearest * significand) * 2
    odd = (nearest & 1) == 1
    nearest = nearest + (
        (twice_remainder > significand) | ((twice_remainder == significand) & odd)
    ).astype(jnp.int32) - ((twice_remainder < -significand) | ((twice_remainder == -significand) & odd)).astype(jnp.int32)
    subnormal_result = from_bits(nearest | (bits & _SIGN))
    magnitude = bits & _MAGNITUDE_MASK
    large = (magnitude > 0x7E800000) & (magnitude < _EXPONENT_MASK)
    return jnp.where(large, subnormal_result, 1.0 / scale)


def cast_to_fp8(x: jax.Array, dtype) -> jax.Array:
    """Cast to FP8 with round-to-nearest-even, saturating: finite values and infinities
    beyond the largest finite value become ``+-max``; NaN stays NaN.

    Computed on the float32 bits (as fp8train's CPU kernels do), not by XLA's conversion,
    whose rounding has differed between releases (some round twice, through float16).

    Args:
        x: float32, bfloat16 or float16 array of any shape.
        dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.

    Returns:
        An array of ``dtype`` with the shape of ``x``.

    Raises:
        ValueError: an unsupported target or source dtype.
    """
    x = check_array("x", x)
    fmt = _check_fp8_data_dtype(dtype)
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"cast_to_fp8 takes float32, bfloat16 or float16 input, got {x.dtype}; convert it first")
    return lax.bitcast_convert_type(_fp8_codes(to_float32(x), fmt), jax_dtype(fmt))


def _fp8_codes(x32: jax.Array, fmt: FloatFormat) -> jax.Array:
    """uint8 codes of the saturating round-to-nearest-even cast of float32 ``x32``."""
    m, bias = fmt.mantissa_bits, fmt.bias
    bits = float32_bits(x32)
    magnitude = bits & _MAGNITUDE_MASK
    sign = (bits >> 24) & 0x80  # the sign bit, moved to bit 7 (arithmetic shift keeps it)
    biased = magnitude >> 23
    # Normal FP8 values: round the float32 mantissa to m bits (ties to even; a carry moves
    # into the exponent), then rebias the exponent.
    shift = 23 - m
    rounded = magnitude + ((1 << (shift - 1)) - 1) + ((magnitude >> shift) & 1)
    normal_code = (rounded >> shift) - ((127 - bias) << m)
    # FP8 subnormals: the 24-bit significand in units of the smallest subnormal, rounded to
    # nearest even; 2^m units is the smallest normal, whose code is 2^m: the two join.
    significand = (magnitude & _MANTISSA_MASK) | 0x800000
    right = jnp.clip((151 - bias - m) - biased, 0, 25)
    half = jnp.left_shift(jnp.int32(1), jnp.maximum(right - 1, 0))
    odd = jnp.right_shift(significand, right) & 1
    subnormal_code = jnp.where(right >= 25, 0, jnp.right_shift(significand + half - 1 + odd, right))
    code = jnp.where(biased >= 128 - bias, normal_code, subnormal_code)
    max_bits = int(np.array(fmt.max, np.float32).view(np.int32))
    max_code = int(np.array(fmt.max, np.float32).astype(getattr(ml_dtypes, fmt.dtype_name)).view(np.uint8))
    code = jnp.where(magnitude >= max_bits, max_code, code)  # saturate (infinities too)
    nan_code = 0x7F if fmt.nan_uses_top_mantissa_only else 0x7E
    code = jnp.where(magnitude > _EXPONENT_MASK, nan_code, code | sign)
    return code.astype(jnp.uint8)


def _check_fp8_data_dtype(dtype) -> FloatFormat:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        pass
    if dtype not in FP8_DATA_DTYPES:
        name = dtype.name if isinstance(dtype, np.dtype) else repr(dtype)
        raise ValueError(f"dtype={name} is not an FP8 data dtype; use jnp.float8_e4m3fn or jnp.float8_e5m2")
    return _FORMATS_BY_DTYPE[dtype]
