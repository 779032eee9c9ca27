"""The numba kernel behind :func:`.operands.scaled_fp8_values`: FP8 codes times
power-of-two scales, as the emulated GEMM's operands: exact in float32, and in bfloat16
wherever the reference's bfloat16 multiply is (it rounds the same product). Also the same
arithmetic for a run of codes the quantizers of :mod:`.numba_fp8` have just written
(:func:`write_values_run`, :func:`write_values_columns`): the operand in the quantizer's
pass, where the layer asks for it (issue 38). Imported only when numba is.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from .numba_elements import INF_BITS, F, U, at, bfloat16_bits, f32_bits, f32_from_bits


def _narrow(value, like):
    """``value`` (float32) in the dtype of ``like``: float32 as is, bfloat16 bits (uint16)
    rounded to nearest even."""


@overload(_narrow, inline="always")
def _narrow_impl(value, like):
    if like == types.uint16:
        return lambda value, like: bfloat16_bits(value)
    if like == types.float32:
        return lambda value, like: value
    return None



@numba.njit(cache=True, inline="always", error_model="numpy")
def _fp8_value(code, shift, restore, special, inf_code):
    """The float32 value of an FP8 code: its fields shifted into float32's (value *
    2^-restore_exponent, exact), one multiply back; NaN and E5M2 infinities by code."""
    u = U(code)
    sign = U(U(u & U(0x80)) << U(24))
    magnitude = U(u & U(0x7F))
    finite = f32_bits(F(f32_from_bits(U(magnitude << shift)) * restore))
    special_bits = INF_BITS if magnitude == inf_code else U(0x7FC00000)
    return f32_from_bits(U((special_bits if magnitude >= special else finite) | sign))


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def scaled_fp8_values(codes, out, scales, rows, cols, e4m3):
    """``out = value(codes) * scale`` of each element's ``rows x cols`` group."""
    m, n = codes.shape
    shift = U(20) if e4m3 else U(21)
    restore = F(2.0**120) if e4m3 else F(2.0**112)
    special = U(0x7F) if e4m3 else U(0x7C)
    inf_code = U(0x100) if e4m3 else U(0x7C)
    for i in prange(m):
        if cols == 1:  # one scale per column: the scale row holds the column scales
            _scale_fp8_row(codes[i], out[i], scales[i // rows], shift, restore, special, inf_code)
        else:
            column_scales = np.empty(n, dtype=np.float32)
            for g in range(n // cols):
                column_scales[g * cols : (g + 1) * cols] = scales[i // rows, g]
            _scale_fp8_row(codes[i], out[i], column_scales, shift, restore, special, inf_code)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _scale_fp8_row(src, dst, column_scales, shift, restore, special, inf_code):
    for j in range(src.shape[0]):
        value = F(_fp8_value(src[j], shift, restore, special, inf_code) * column_scales[j])
        dst[j] = _narrow(value, dst[j])


@numba.njit(cache=True, error_model="numpy")
def scaled_fp8_values_at(codes, m, n, out, like, scales, scale_rows, scale_cols, rows, cols, e4m3, e8m0):
    """:func:`scaled_fp8_values` by address (:func:`.numba_elements.at`): ``m x n`` uint8
    codes, ``out`` of ``like``'s dtype, scales ``scale_rows x scale_cols``: float32, or
    E8M0 codes (uint8) with ``e8m0``, decoded here (:func:`e8m0_value`) where the host took
    a view, a conversion and a table lookup (issue 38)."""
    if e8m0:
        stored = np.empty((scale_rows, scale_cols), dtype=np.float32)
        exponents = at(scales, (scale_rows, scale_cols), np.uint8(0))
        for i in range(scale_rows):
            for j in range(scale_cols):
                stored[i, j] = e8m0_value(exponents[i, j])
    else:
        stored = at(scales, (scale_rows, scale_cols), np.float32(0))
    scaled_fp8_values(at(codes, (m, n), np.uint8(0)), at(out, (m, n), like), stored, rows, cols, e4m3)


# The operand written by a quantizer, from the codes it has just cast (still in cache). ``kind``
# says where: 0 nowhere, 1 ``vf`` (float32), 2 ``vb`` (bfloat16 bits); ``dec`` is
# :func:`fp8train.quant.kernels.fp8.value_decoding`'s: the format's fields, whether the stored
# scales are E8M0 exponents, and whether the values stay bare (scales not powers of two: the
# GEMM applies them to its output).


@numba.njit(cache=True, inline="always", error_model="numpy")
def values_multiplier(stored, dec):
    """What a group's values are multiplied by: 1 for bare values, else its ``1 / scale``
    from its stored scale (``1 / scale`` itself, or an E8M0 exponent decoded exactly, as
    :func:`fp8train.quant.scaling.e8m0_to_float32`)."""
    _, _, _, _, e8m0, bare = dec  # unpacked, not indexed: parfors take an indexed value for an array
    if bare:
        return F(1.0)
    if not e8m0:
        return F(stored)
    return e8m0_value(stored)


@numba.njit(cache=True, inline="always", error_model="numpy")
def e8m0_value(code):
    """The float32 value of an E8M0 code (0-255, of any numeric type), exactly as
    :func:`fp8train.quant.scaling.e8m0_to_float32` decodes it: 2^(code - 127), the
    subnormal 2^-127 for 0, NaN for 255."""
    exponent = U(code)
    normal = f32_from_bits(U(exponent << U(23)))
    decoded = f32_from_bits(U(1) << U(22)) if exponent == U(0) else normal
    return f32_from_bits(U(0x7FC00000)) if exponent == U(0xFF) else decoded


@numba.njit(cache=True, inline="always", error_model="numpy")
def write_values_run(codes, vf, vb, kind, multiplier, dec):
    """The values of a run of ``codes`` of one group, times ``multiplier``."""
    shift, restore, special, inf_code, _, _ = dec
    if kind == 1:
        for j in range(codes.shape[0]):
            vf[j] = F(_fp8_value(codes[j], shift, restore, special, inf_code) * multiplier)
    elif kind == 2:
        for j in range(codes.shape[0]):
            vb[j] = bfloat16_bits(F(_fp8_value(codes[j], shift, restore, special, inf_code) * multiplier))


@numba.njit(cache=True, inline="always", error_model="numpy")
def write_values_columns(codes, vf, vb, kind, multipliers, dec):
    """The values of a run of ``codes`` across groups, each times its column's multiplier."""
    shift, restore, special, inf_code, _, _ = dec
    if kind == 1:
        for j in range(codes.shape[0]):
            vf[j] = F(_fp8_value(codes[j], shift, restore, special, inf_code) * multipliers[j])
    elif kind == 2:
        for j in range(codes.shape[0]):
            vb[j] = bfloat16_bits(F(_fp8_value(codes[j], shift, restore, special, inf_code) * multipliers[j]))


@numba.njit(cache=True, inline="always", error_model="numpy")
def column_multipliers(stored, dec):
    """:func:`values_multiplier` of each stored scale of a row of scales."""
    out = np.empty(stored.shape[0], dtype=np.float32)
    for j in range(stored.shape[0]):
        out[j] = values_multiplier(stored[j], dec)
    return out
