"""The numba kernels behind :mod:`fp8train.quant.kernels` (imported only when numba is).

Integers are wrapped in ``U(...)`` throughout: numba widens integer arithmetic to 64 bits,
and the bit patterns here are float32's. ``F(...)`` keeps float arithmetic in float32, as
the reference's tensors are. ``.view`` is taken only on values built by ``U()``/``F()``
(a numba restriction).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

U = np.uint32
I = np.int32
F = np.float32
_SIGN_OFF = U(0x7FFFFFFF)
_INF_BITS = U(0x7F800000)
_FLOAT32_POW2_MASK = U(0xFF800000)


def set_threads(count: int) -> None:
    numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))


def magnitude_bits(v):
    """The magnitude bits of one element in its own width (integer max = amax; NaN wins)."""


@overload(magnitude_bits, inline="always")
def _magnitude_impl(v):
    if v == types.uint16:  # bfloat16
        return lambda v: np.uint16(v & np.uint16(0x7FFF))
    if v == types.uint32:  # float32
        return lambda v: U(v & _SIGN_OFF)
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
def _bits(f):
    return F(f).view(U)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _float(u):
    return U(u).view(F)


@numba.njit(cache=True, inline="always", error_model="numpy")
def encode_fp8(product, enc):
    """The FP8 code of the float32 ``product`` (round to nearest even, saturating; NaN gives
    the positive NaN code: a NaN's sign is not part of the contract, and the reference's
    own depends on which PyTorch vector path ran)."""
    shift, rebias, max_bits, max_code, min_normal_bits, magic, magic_bits = enc
    u = _bits(product)
    sign = U(U(u >> U(24)) & U(0x80))
    a = U(u & _SIGN_OFF)
    half_minus_one = U(U(U(1) << U(shift - U(1))) - U(1))
    tie_to_even = U(U(a >> shift) & U(1))
    normal = U(U(U(U(a + half_minus_one) + tie_to_even) >> shift) - rebias)
    subnormal = U(_bits(F(_float(a) + magic)) - magic_bits)
    code = subnormal if a < min_normal_bits else normal
    code = U((max_code if a >= max_bits else code) | sign)
    return np.uint8(U(0x7F) if a > _INF_BITS else code)


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
        scale = _float(U(_bits(scale) & _FLOAT32_POW2_MASK)) if power_2 else scale
        return scale, F(F(1.0) / scale)
    exponent = _mx_exponent(amax, kind, reciprocal, emax)
    unbiased = I(I(127) - exponent)
    normal = _float(U(I(unbiased + I(127)) << I(23)))
    subnormal = _float(U(U(1) << U(max(I(0), I(unbiased + I(149))))))
    scale = normal if unbiased >= I(-126) else subnormal
    return (F(np.nan) if exponent == I(0xFF) else scale), F(exponent)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _mx_exponent(amax, kind, reciprocal, emax):
    """The biased E8M0 exponent of a block (``mx_scale_exponent``'s two rules), int32."""
    if kind == 1:  # "ceil": the smallest power of two >= amax / fp8_max
        t = F(amax * reciprocal)
        bits = _bits(t)
        biased = I(bits >> U(23))
        mantissa = U(bits & U(0x7FFFFF))
        round_up = (mantissa > U(0x400000)) if biased == I(0) else (mantissa != U(0))
        exponent = I(biased + I(round_up))
        exponent = I(0) if t == F(0) else exponent
    else:  # "ocp": floor(log2(amax)) - emax, clamped to [0, 254]
        bits = _bits(amax)
        biased = I(bits >> U(23))
        # floor(log2) of a subnormal's mantissa: the exponent of the mantissa as a float.
        top = I(I(_bits(F(U(bits & U(0x7FFFFF)))) >> U(23)) - I(127))
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
def _cast_run(src, dst, scale, enc):
    for j in range(src.shape[0]):
        dst[j] = encode_fp8(F(to_float32(src[j]) * scale), enc)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _scales_of_peaks(work, stored, rule):
    """``work`` holds group amaxes; replace them by the scales, and fill ``stored``."""
    for g in range(work.shape[0]):
        scale, kept = group_scale(work[g], rule)
        work[g] = scale
        stored[g] = kept


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_row_groups(x, out, scales, cols, rule, enc):
    """Groups of one row by ``cols`` columns: each row is read from memory once."""
    m, n = x.shape
    work = np.empty((m, n // cols), dtype=np.float32)
    for i in prange(m):
        for g in range(n // cols):
            work[i, g] = to_float32(peak_bits(x[i, g * cols : (g + 1) * cols]))
        _scales_of_peaks(work[i], scales[i], rule)
        for g in range(n // cols):
            _cast_run(x[i, g * cols : (g + 1) * cols], out[i, g * cols : (g + 1) * cols], work[i, g], enc)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _tile(task, tasks_per_stripe, width, n):
    """``(stripe, first column, end column)`` of one task of a striped kernel."""
    c0 = (task % tasks_per_stripe) * width
    return task // tasks_per_stripe, c0, min(n, c0 + width)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_stripe_groups(x, out, scales, rows, cols, width, rule, enc):
    """Groups of ``rows`` (> 1) rows by ``cols`` columns. A task takes one stripe of ``rows``
    rows by ``width`` columns (whole groups): column maxima over the rows, group scales,
    then the cast, whose read finds the stripe in cache."""
    m, n = x.shape
    tasks_per_stripe = (n + width - 1) // width
    for task in prange((m // rows) * tasks_per_stripe):
        stripe, c0, c1 = _tile(task, tasks_per_stripe, width, n)
        peaks = column_peaks(x, stripe * rows, (stripe + 1) * rows, c0, c1)
        groups = (c1 - c0) // cols
        work = np.empty(groups, dtype=np.float32)
        if cols == 1:  # one group per column: no per-group slices (they cost more than the work)
            for j in range(groups):
                work[j] = to_float32(peaks[j])
            _scales_of_peaks(work, scales[stripe, c0:c1], rule)
            for i in range(stripe * rows, (stripe + 1) * rows):
                _cast_columns(x[i, c0:c1], out[i, c0:c1], work, enc)
        else:
            for g in range(groups):
                work[g] = to_float32(peak_bits(peaks[g * cols : (g + 1) * cols]))
            _scales_of_peaks(work, scales[stripe, c0 // cols : c0 // cols + groups], rule)
            column_scales = np.empty(c1 - c0, dtype=np.float32)
            for g in range(groups):
                column_scales[g * cols : (g + 1) * cols] = work[g]
            for i in range(stripe * rows, (stripe + 1) * rows):
                _cast_columns(x[i, c0:c1], out[i, c0:c1], column_scales, enc)


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
def _cast_columns(src, dst, column_scales, enc):
    for j in range(src.shape[0]):
        dst[j] = encode_fp8(F(to_float32(src[j]) * column_scales[j]), enc)


@numba.njit(cache=True, error_model="numpy")
def _column_amaxes(partial):
    """Float32 column amaxes from per-chunk column maxima of the magnitude bits."""
    work = np.empty(partial.shape[1], dtype=np.float32)
    for j in range(partial.shape[1]):
        peak = partial[0, j]
        for c in range(partial.shape[0]):
            peak = max(peak, partial[c, j])
        work[j] = to_float32(peak)
    return work


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_column_groups(x, out, scales, chunks, rule, enc):
    """One group per column (all rows): column maxima over row chunks in parallel, then a
    second, streaming read for the cast."""
    m, n = x.shape
    per_chunk = (m + chunks - 1) // chunks
    partial = np.zeros((chunks, n), dtype=x.dtype)
    for c in prange(chunks):
        partial[c] = column_peaks(x, c * per_chunk, min(m, (c + 1) * per_chunk), 0, n)
    work = _column_amaxes(partial)
    _scales_of_peaks(work, scales[0], rule)
    for i in prange(m):
        _cast_columns(x[i], out[i], work, enc)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def max_magnitude(x):
    """The largest magnitude bits of ``x`` (its amax; a NaN's bits if it holds a NaN)."""
    m = x.shape[0]
    peaks = np.zeros(m, dtype=x.dtype)
    for i in prange(m):
        peaks[i] = peak_bits(x[i])
    return peaks.max()


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def cast_scaled(x, out, scale, enc):
    """``cast(x * scale)`` for one float32 ``scale``."""
    for i in prange(x.shape[0]):
        _cast_run(x[i], out[i], scale, enc)


# Both usages of one tensor from one read: groups of one row by ``block`` columns (axis -1)
# and of ``block`` rows by one column (axis 0), as the rowwise, blockwise and MX recipes
# quantize an input or a grad_output for two GEMMs.


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_both_blocks(x, out_last, out_first, scales_last, scales_first, block, width, rule, enc):
    """A task takes ``block`` rows by ``width`` columns: row-group and column maxima in one
    read, both sets of scales, then both casts from cache."""
    m, n = x.shape
    tasks_per_stripe = (n + width - 1) // width
    for task in prange((m // block) * tasks_per_stripe):
        stripe, c0, c1 = _tile(task, tasks_per_stripe, width, n)
        r0 = stripe * block
        groups = (c1 - c0) // block
        row_work = np.empty((block, groups), dtype=np.float32)
        column_peaks = np.zeros(c1 - c0, dtype=x.dtype)
        for i in range(r0, r0 + block):
            src = x[i, c0:c1]
            for j in range(src.shape[0]):
                column_peaks[j] = max(column_peaks[j], magnitude_bits(src[j]))
            for g in range(groups):
                row_work[i - r0, g] = to_float32(peak_bits(x[i, c0 + g * block : c0 + (g + 1) * block]))
            _scales_of_peaks(row_work[i - r0], scales_last[i, c0 // block : c0 // block + groups], rule)
        column_work = np.empty(c1 - c0, dtype=np.float32)
        for j in range(c1 - c0):
            column_work[j] = to_float32(column_peaks[j])
        _scales_of_peaks(column_work, scales_first[stripe, c0:c1], rule)
        for i in range(r0, r0 + block):
            for g in range(groups):
                lo, hi = c0 + g * block, c0 + (g + 1) * block
                _cast_run(x[i, lo:hi], out_last[i, lo:hi], row_work[i - r0, g], enc)
            _cast_columns(x[i, c0:c1], out_first[i, c0:c1], column_work, enc)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_both_rows(x, out_last, out_first, scales_last, scales_first, chunks, rule, enc):
    """One group per row and one per column: row and column maxima in one read (row
    chunks in parallel), then both casts in a second read."""
    m, n = x.shape
    per_chunk = (m + chunks - 1) // chunks
    partial = np.zeros((chunks, n), dtype=x.dtype)
    row_work = np.empty(m, dtype=np.float32)
    for c in prange(chunks):
        for i in range(c * per_chunk, min(m, (c + 1) * per_chunk)):
            src = x[i]
            peaks = partial[c]
            row_peak = magnitude_bits(src[0])
            for j in range(n):
                magnitude = magnitude_bits(src[j])
                peaks[j] = max(peaks[j], magnitude)
                row_peak = max(row_peak, magnitude)
            row_work[i] = to_float32(row_peak)
    _scales_of_peaks(row_work, scales_last[:, 0], rule)
    column_work = _column_amaxes(partial)
    _scales_of_peaks(column_work, scales_first[0], rule)
    for i in prange(m):
        _cast_run(x[i], out_last[i], row_work[i], enc)
        _cast_columns(x[i], out_first[i], column_work, enc)


# FP8 codes times power-of-two scales, as the emulated GEMM's operands: exact in float32,
# and in bfloat16 wherever the reference's bfloat16 multiply is (it rounds the same product).


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
def bfloat16_bits(value):
    """float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN)."""
    bits = _bits(value)
    rounded = U(U(bits + U(0x7FFF) + U(U(bits >> U(16)) & U(1))) >> U(16))
    quiet_nan = U(U(bits >> U(16)) | U(0x40))
    return np.uint16(quiet_nan if U(bits & _SIGN_OFF) > _INF_BITS else rounded)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _fp8_value(code, shift, restore, special, inf_code):
    """The float32 value of an FP8 code: its fields shifted into float32's (value *
    2^-restore_exponent, exact), one multiply back; NaN and E5M2 infinities by code."""
    u = U(code)
    sign = U(U(u & U(0x80)) << U(24))
    magnitude = U(u & U(0x7F))
    finite = _bits(F(_float(U(magnitude << shift)) * restore))
    special_bits = _INF_BITS if magnitude == inf_code else U(0x7FC00000)
    return _float(U((special_bits if magnitude >= special else finite) | sign))


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


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_tensor(x, out, rule, enc):
    """One scale for all of ``x``: the amax (rows in parallel), the scale, then the cast.
    Returns ``(scale, 1 / scale)``."""
    m = x.shape[0]
    peaks = np.zeros(m, dtype=x.dtype)
    for i in prange(m):
        peaks[i] = peak_bits(x[i])
    scale, stored = group_scale(to_float32(peaks.max()), rule)
    for i in prange(m):
        _cast_run(x[i], out[i], scale, enc)
    return scale, stored
