"""What every numba kernel of the package computes per element and per group, in float32's
bits: an input element's magnitude bits and value, a run's peak, the FP8 cast (round to
nearest even, saturating), the scale rule of one group, float32 to bfloat16. The kernels of
:mod:`.numba_fp8`, :mod:`.numba_fp8_values`, :mod:`.numba_fp4` and
:mod:`.numba_fp4_transform` inline them (imported only when numba is).

Integers are wrapped in ``U(...)`` throughout: numba widens integer arithmetic to 64 bits,
and the bit patterns here are float32's. ``F(...)`` keeps float arithmetic in float32, as
the reference's tensors are. ``.view`` is taken only on values built by ``U()``/``F()``
(a numba restriction).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.numpy_support import as_dtype

U = np.uint32
I = np.int32
F = np.float32
SIGN_OFF = U(0x7FFFFFFF)
INF_BITS = U(0x7F800000)
_FLOAT32_POW2_MASK = U(0xFF800000)


def set_threads(count: int) -> None:
    numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))


@intrinsic
def _pointer(typingctx, address):
    """An integer address as a ``void*``."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.intp), codegen


def at(address, shape, like):
    """The C-contiguous array of ``shape`` and ``like``'s dtype (a NumPy scalar of it) at
    ``address``: a contiguous tensor's ``data_ptr()``, which its caller holds for the launch.

    How the kernels' ``*_at`` entry points take tensors: one host call each
    (``Tensor.data_ptr``), where a NumPy view over the memory costs four (issue 38).
    """


@overload(at, inline="always")
def _at_impl(address, shape, like):
    dtype = as_dtype(like)
    return lambda address, shape, like: carray(_pointer(address), shape, dtype)


def magnitude_bits(v):
    """The magnitude bits of one element in its own width (integer max = amax; NaN wins)."""


@overload(magnitude_bits, inline="always")
def _magnitude_impl(v):
    if v == types.uint16:  # bfloat16
        return lambda v: np.uint16(v & np.uint16(0x7FFF))
    if v == types.uint32:  # float32
        return lambda v: U(v & SIGN_OFF)
    return None


def to_float32(v):
    """One element's value as float32 (exact for all three input dtypes)."""


@overload(to_float32, inline="always")
def _to_float32_impl(v):
    if v == types.uint16:
        return lambda v: U(U(v) << U(16)).view(F)
    if v == types.uint32:
        return lambda v: U(v).view(F)
    return None


@numba.njit(cache=True, inline="always", error_model="numpy")
def f32_bits(f):
    return F(f).view(U)


@numba.njit(cache=True, inline="always", error_model="numpy")
def f32_from_bits(u):
    return U(u).view(F)


@numba.njit(cache=True, inline="always", error_model="numpy")
def encode_fp8(product, enc):
    """The FP8 code of the float32 ``product`` (round to nearest even, saturating; NaN gives
    the positive NaN code: a NaN's sign is not part of the contract, and the reference's
    own depends on which PyTorch vector path ran)."""
    shift, rebias, max_bits, max_code, min_normal_bits, magic, magic_bits = enc
    u = f32_bits(product)
    sign = U(U(u >> U(24)) & U(0x80))
    a = U(u & SIGN_OFF)
    half_minus_one = U(U(U(1) << U(shift - U(1))) - U(1))
    tie_to_even = U(U(a >> shift) & U(1))
    normal = U(U(U(U(a + half_minus_one) + tie_to_even) >> shift) - rebias)
    subnormal = U(f32_bits(F(f32_from_bits(a) + magic)) - magic_bits)
    code = subnormal if a < min_normal_bits else normal
    code = U((max_code if a >= max_bits else code) | sign)
    return np.uint8(U(0x7F) if a > INF_BITS else code)


@numba.njit(cache=True, inline="always", error_model="numpy")
def group_scale(amax, rule):
    """``(scale, stored)`` of one group from its float32 amax: ``stored`` is ``1 / scale``,
    or the biased E8M0 exponent for the MX rules (NUMERICS.md sections 2 and 3). Selects,
    not branches, so a loop over groups vectorizes."""
    kind, fp8_max, reciprocal, emax, power_2, epsilon, inf_value = rule
    amax = epsilon if amax < epsilon else amax
    if kind == 0:
        scale = F(fp8_max / amax)
        scale = inf_value if scale == F(np.inf) else scale
        scale = scale if (amax != F(0) and amax < F(np.inf)) else F(1.0)
        scale = f32_from_bits(U(f32_bits(scale) & _FLOAT32_POW2_MASK)) if power_2 else scale
        return scale, F(F(1.0) / scale)
    exponent = _mx_exponent(amax, kind, reciprocal, emax)
    unbiased = I(I(127) - exponent)
    normal = f32_from_bits(U(I(unbiased + I(127)) << I(23)))
    subnormal = f32_from_bits(U(U(1) << U(max(I(0), I(unbiased + I(149))))))
    scale = normal if unbiased >= I(-126) else subnormal
    return (F(np.nan) if exponent == I(0xFF) else scale), F(exponent)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _mx_exponent(amax, kind, reciprocal, emax):
    """The biased E8M0 exponent of a block (``mx_scale_exponent``'s two rules), int32."""
    if kind == 1:  # "ceil": the smallest power of two >= amax / fp8_max
        t = F(amax * reciprocal)
        bits = f32_bits(t)
        biased = I(bits >> U(23))
        mantissa = U(bits & U(0x7FFFFF))
        round_up = (mantissa > U(0x400000)) if biased == I(0) else (mantissa != U(0))
        exponent = I(biased + I(round_up))
        exponent = I(0) if t == F(0) else exponent
    else:  # "ocp": floor(log2(amax)) - emax, clamped to [0, 254]
        bits = f32_bits(amax)
        biased = I(bits >> U(23))
        # floor(log2) of a subnormal's mantissa: the exponent of the mantissa as a float.
        top = I(I(f32_bits(F(U(bits & U(0x7FFFFF)))) >> U(23)) - I(127))
        floor_log2 = I(biased - I(127)) if biased > I(0) else I(top - I(149))
        exponent = I(min(max(I(floor_log2 - I(emax) + I(127)), I(0)), I(254)))
        exponent = I(0) if amax == F(0) else exponent
    exponent = I(0xFE) if amax == F(np.inf) else exponent
    return I(0xFF) if amax != amax else exponent


# Inner loops run over 1-D slices from index 0: with a provably non-negative index numba
# drops its negative-index wraparound, and LLVM vectorizes the loop (3x faster).


@numba.njit(cache=True, inline="always", error_model="numpy")
def peak_bits(src):
    peak = magnitude_bits(src[0])
    for j in range(src.shape[0]):
        peak = max(peak, magnitude_bits(src[j]))
    return peak




@numba.njit(cache=True, inline="always", error_model="numpy")
def column_peaks(x, r0, r1, c0, c1):
    """Column maxima of the magnitudes of ``x[r0:r1, c0:c1]``. (Rows are sliced one at a
    time: a row of a 2-D slice would lose its known unit stride, and with it vectorization.)"""
    peaks = np.zeros(c1 - c0, dtype=x.dtype)
    for i in range(r0, r1):
        src = x[i, c0:c1]
        for j in range(src.shape[0]):
            peaks[j] = max(peaks[j], magnitude_bits(src[j]))
    return peaks



@numba.njit(cache=True, inline="always", error_model="numpy")
def bfloat16_bits(value):
    """float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN)."""
    bits = f32_bits(value)
    rounded = U(U(bits + U(0x7FFF) + U(U(bits >> U(16)) & U(1))) >> U(16))
    quiet_nan = U(U(bits >> U(16)) | U(0x40))
    return np.uint16(quiet_nan if U(bits & SIGN_OFF) > INF_BITS else rounded)

