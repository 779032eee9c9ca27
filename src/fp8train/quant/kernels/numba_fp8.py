"""The numba kernels behind :mod:`.fp8`: FP8 quantization of a 2-D input's bits in groups
of one row, of strided rows (stripes), of whole columns, of the whole tensor, and both
usages of one tensor from one read; and the tensor's amax (imported only when numba is).
The arithmetic of one element and one group is :mod:`.numba_elements`'s.

Each quantizer also writes the emulated GEMM's operand of what it quantized where asked
(``vkind`` 1: float32 into ``vf``, 2: bfloat16 bits into ``vb``, 0: nothing), from the codes
it has just written, as :mod:`.numba_fp8_values` computes it (``vdec``): the operand in the
quantizer's pass (issue 38).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .numba_delayed import fold_max
from .numba_elements import F, U, at, column_peaks, encode_fp8, group_scale, magnitude_bits, peak_bits, to_float32
from .numba_fp8_values import column_multipliers, values_multiplier, write_values_columns, write_values_run


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


TASK_ELEMENTS = 1 << 13
"""About the elements one task of :func:`quantize_row_groups` takes, in whole rows (its
buffers allocated once a task, not once a row; long rows one a task, as many tasks as rows)."""
LONG_GROUP = 128
"""Groups at least this long (1x128 blocks, whole rows) write a row's operand a group at a
time; shorter ones (MX's 32) through one loop over the row (:func:`quantize_row_groups`)."""


@numba.njit(cache=True, inline="always", error_model="numpy")
def _row_values(codes, vf, vb, kind, stored, cols, multipliers, vdec):
    """The operand of a run of ``codes`` in groups of ``cols`` (``stored``: their stored
    scales): a group at a time where groups are :data:`LONG_GROUP` or longer, else through
    ``multipliers`` (a buffer as long as the run), each group's spread over its columns,
    and one loop over the run."""
    groups = codes.shape[0] // cols
    if cols >= LONG_GROUP:
        for g in range(groups):
            lo, hi = g * cols, (g + 1) * cols
            write_values_run(codes[lo:hi], vf[lo:hi], vb[lo:hi], kind, values_multiplier(stored[g], vdec), vdec)
    else:
        for g in range(groups):
            multipliers[g * cols : (g + 1) * cols] = values_multiplier(stored[g], vdec)
        write_values_columns(codes, vf, vb, kind, multipliers, vdec)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_row_groups(x, out, scales, cols, rule, enc, vf, vb, vkind, vdec):
    """Groups of one row by ``cols`` columns: each row is read from memory once. The
    operand's multipliers of short groups are spread over a row's columns first, so that its
    values run as one long loop, which vectorizes (a loop per group of 32, MX's, did not:
    issue 38)."""
    m, n = x.shape
    groups, per_task = n // cols, max(1, TASK_ELEMENTS // max(1, n))
    for task in prange((m + per_task - 1) // per_task):
        work = np.empty(groups, dtype=np.float32)
        multipliers = np.empty(n if vkind and cols < LONG_GROUP else 0, dtype=np.float32)  # (_row_values)
        for i in range(task * per_task, min(m, (task + 1) * per_task)):
            for g in range(groups):
                work[g] = to_float32(peak_bits(x[i, g * cols : (g + 1) * cols]))
            _scales_of_peaks(work, scales[i], rule)
            for g in range(groups):
                lo, hi = g * cols, (g + 1) * cols
                _cast_run(x[i, lo:hi], out[i, lo:hi], work[g], enc)
            if vkind:
                _row_values(out[i], vf[i], vb[i], vkind, scales[i], cols, multipliers, vdec)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _tile(task, tasks_per_stripe, width, n):
    """``(stripe, first column, end column)`` of one task of a striped kernel."""
    c0 = (task % tasks_per_stripe) * width
    return task // tasks_per_stripe, c0, min(n, c0 + width)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_stripe_groups(x, out, scales, rows, cols, width, rule, enc, vf, vb, vkind, vdec):
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
            multipliers = column_multipliers(scales[stripe, c0:c1], vdec)
            for i in range(stripe * rows, (stripe + 1) * rows):
                _cast_columns(x[i, c0:c1], out[i, c0:c1], work, enc)
                if vkind:
                    write_values_columns(out[i, c0:c1], vf[i, c0:c1], vb[i, c0:c1], vkind, multipliers, vdec)
        else:
            for g in range(groups):
                work[g] = to_float32(peak_bits(peaks[g * cols : (g + 1) * cols]))
            _scales_of_peaks(work, scales[stripe, c0 // cols : c0 // cols + groups], rule)
            column_scales = np.empty(c1 - c0, dtype=np.float32)
            multipliers = np.empty(c1 - c0, dtype=np.float32)
            for g in range(groups):
                column_scales[g * cols : (g + 1) * cols] = work[g]
                multipliers[g * cols : (g + 1) * cols] = values_multiplier(scales[stripe, c0 // cols + g], vdec)
            for i in range(stripe * rows, (stripe + 1) * rows):
                _cast_columns(x[i, c0:c1], out[i, c0:c1], column_scales, enc)
                if vkind:
                    write_values_columns(out[i, c0:c1], vf[i, c0:c1], vb[i, c0:c1], vkind, multipliers, vdec)




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
def quantize_column_groups(x, out, scales, chunks, rule, enc, vf, vb, vkind, vdec):
    """One group per column (all rows): column maxima over row chunks in parallel, then a
    second, streaming read for the cast."""
    m, n = x.shape
    per_chunk = (m + chunks - 1) // chunks
    partial = np.zeros((chunks, n), dtype=x.dtype)
    for c in prange(chunks):
        partial[c] = column_peaks(x, c * per_chunk, min(m, (c + 1) * per_chunk), 0, n)
    work = _column_amaxes(partial)
    _scales_of_peaks(work, scales[0], rule)
    multipliers = column_multipliers(scales[0], vdec)
    for i in prange(m):
        _cast_columns(x[i], out[i], work, enc)
        if vkind:
            write_values_columns(out[i], vf[i], vb[i], vkind, multipliers, vdec)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def max_magnitude(x):
    """The largest magnitude bits of ``x`` (its amax; a NaN's bits if it holds a NaN)."""
    m = x.shape[0]
    peaks = np.zeros(m, dtype=x.dtype)
    for i in prange(m):
        peaks[i] = peak_bits(x[i])
    return peaks.max()


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def cast_scaled(x, out, scale, enc, vf, vb, vkind, vdec, peaks):
    """``cast(x * scale)`` for one float32 ``scale`` (its values bare: a given scale is
    applied to the GEMM's output); where ``peaks`` has a slot per row, each row's largest
    magnitude bits too, read as :func:`max_magnitude` reads them (delayed scaling's amax)."""
    record = peaks.shape[0] > 0
    for i in prange(x.shape[0]):
        if record:
            peaks[i] = peak_bits(x[i])
        _cast_run(x[i], out[i], scale, enc)
        if vkind:
            write_values_run(out[i], vf[i], vb[i], vkind, F(1.0), vdec)


# Both usages of one tensor from one read: groups of one row by ``block`` columns (axis -1)
# and of ``block`` rows by one column (axis 0), as the rowwise, blockwise and MX recipes
# quantize an input or a grad_output for two GEMMs.


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_both_blocks(x, out_last, out_first, scales_last, scales_first, block, width, rule, enc, values):
    """A task takes ``block`` rows by ``width`` columns: row-group and column maxima in one
    read, both sets of scales, then both casts from cache."""
    m, n = x.shape
    vf_last, vb_last, kind_last, vf_first, vb_first, kind_first, vdec = values
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
        multipliers = column_multipliers(scales_first[stripe, c0:c1], vdec)
        row_multipliers = np.empty(c1 - c0 if kind_last and block < LONG_GROUP else 0, dtype=np.float32)
        for i in range(r0, r0 + block):
            for g in range(groups):
                lo, hi = c0 + g * block, c0 + (g + 1) * block
                _cast_run(x[i, lo:hi], out_last[i, lo:hi], row_work[i - r0, g], enc)
            if kind_last:
                stored = scales_last[i, c0 // block : c0 // block + groups]
                _row_values(out_last[i, c0:c1], vf_last[i, c0:c1], vb_last[i, c0:c1], kind_last, stored, block, row_multipliers, vdec)
            _cast_columns(x[i, c0:c1], out_first[i, c0:c1], column_work, enc)
            if kind_first:
                write_values_columns(out_first[i, c0:c1], vf_first[i, c0:c1], vb_first[i, c0:c1], kind_first, multipliers, vdec)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_both_rows(x, out_last, out_first, scales_last, scales_first, chunks, rule, enc, values):
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
    vf_last, vb_last, kind_last, vf_first, vb_first, kind_first, vdec = values
    multipliers = column_multipliers(scales_first[0], vdec)
    for i in prange(m):
        _cast_run(x[i], out_last[i], row_work[i], enc)
        if kind_last:
            multiplier = values_multiplier(scales_last[i, 0], vdec)
            write_values_run(out_last[i], vf_last[i], vb_last[i], kind_last, multiplier, vdec)
        _cast_columns(x[i], out_first[i], column_work, enc)
        if kind_first:
            write_values_columns(out_first[i], vf_first[i], vb_first[i], kind_first, multipliers, vdec)



@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_tensor(x, out, rule, enc, vf, vb, vkind, vdec):
    """One scale for all of ``x``: the amax (rows in parallel), the scale, then the cast.
    Returns ``(scale, 1 / scale)``."""
    m = x.shape[0]
    peaks = np.zeros(m, dtype=x.dtype)
    for i in prange(m):
        peaks[i] = peak_bits(x[i])
    scale, stored = group_scale(to_float32(peaks.max()), rule)
    multiplier = values_multiplier(stored, vdec)
    for i in prange(m):
        _cast_run(x[i], out[i], scale, enc)
        if vkind:
            write_values_run(out[i], vf[i], vb[i], vkind, multiplier, vdec)
    return scale, stored


# Entry points by address (:func:`.numba_elements.at`): the kernels above on contiguous
# tensors' memory, ``x`` an ``m x n`` input read as the bits of ``like``'s dtype, the
# outputs uint8 codes and float32 scales in the shapes the kernels above write; ``vals`` the
# address of the ``m x n`` operand written where ``vkind`` asks (0: none, any address).


@numba.njit(cache=True, inline="always", error_model="numpy")
def _values_at(vals, m, n):
    """The operand's memory as float32 and as bfloat16 bits (the kernel writes one, or none)."""
    return at(vals, (m, n), np.float32(0)), at(vals, (m, n), np.uint16(0))


@numba.njit(cache=True, inline="always", error_model="numpy")
def _stored_at(scales, shape, rule):
    """Where a kernel writes its stored scales (float32: ``1 / scale``, or an E8M0 rule's
    exponent): at ``scales``, or for an E8M0 rule (its kind not 0) in a buffer that
    :func:`_e8m0_codes` then stores there as the codes (uint8), so that the host converts
    nothing (issue 38: a conversion and a view each)."""
    if rule[0]:
        return np.empty(shape, dtype=np.float32)
    return at(scales, shape, np.float32(0))


@numba.njit(cache=True, inline="always", error_model="numpy")
def _e8m0_codes(stored, scales, rule):
    """For an E8M0 rule, ``stored``'s exponents (0-255, exact in float32) as uint8 codes at ``scales``."""
    if rule[0]:
        codes = at(scales, stored.shape, np.uint8(0))
        for i in range(stored.shape[0]):
            for j in range(stored.shape[1]):
                codes[i, j] = np.uint8(stored[i, j])


@numba.njit(cache=True, error_model="numpy")
def quantize_row_groups_at(x, like, m, n, out, scales, cols, rule, enc, vals, vkind, vdec):
    codes, stored = at(out, (m, n), np.uint8(0)), _stored_at(scales, (m, n // cols), rule)
    vf, vb = _values_at(vals, m, n)
    quantize_row_groups(at(x, (m, n), like), codes, stored, cols, rule, enc, vf, vb, vkind, vdec)
    _e8m0_codes(stored, scales, rule)


@numba.njit(cache=True, error_model="numpy")
def quantize_stripe_groups_at(x, like, m, n, out, scales, rows, cols, width, rule, enc, vals, vkind, vdec):
    codes, stored = at(out, (m, n), np.uint8(0)), _stored_at(scales, (m // rows, n // cols), rule)
    vf, vb = _values_at(vals, m, n)
    quantize_stripe_groups(at(x, (m, n), like), codes, stored, rows, cols, width, rule, enc, vf, vb, vkind, vdec)
    _e8m0_codes(stored, scales, rule)


@numba.njit(cache=True, error_model="numpy")
def quantize_column_groups_at(x, like, m, n, out, scales, chunks, rule, enc, vals, vkind, vdec):
    codes, stored = at(out, (m, n), np.uint8(0)), _stored_at(scales, (1, n), rule)
    vf, vb = _values_at(vals, m, n)
    quantize_column_groups(at(x, (m, n), like), codes, stored, chunks, rule, enc, vf, vb, vkind, vdec)
    _e8m0_codes(stored, scales, rule)


@numba.njit(cache=True, error_model="numpy")
def max_magnitude_at(x, like, m, n, into):
    """:func:`max_magnitude`, also folded into the float32 at ``into`` (0: nowhere) as
    ``torch.maximum`` folds it (:func:`.numba_delayed.fold_max`: delayed scaling's record)."""
    peak = max_magnitude(at(x, (m, n), like))
    if into:
        fold_max(at(into, (1,), U(0)), to_float32(peak))
    return peak


@numba.njit(cache=True, error_model="numpy")
def cast_scaled_at(x, like, m, n, out, scale, enc, vals, vkind, vdec, into):
    """:func:`cast_scaled`; where ``into`` is an address (0: nowhere) and ``x`` not empty,
    ``max|x|`` also folded into the float32 there, as :func:`max_magnitude_at` folds it."""
    vf, vb = _values_at(vals, m, n)
    source = at(x, (m, n), like)
    peaks = np.zeros(m if into and m * n else 0, dtype=source.dtype)
    cast_scaled(source, at(out, (m, n), np.uint8(0)), scale, enc, vf, vb, vkind, vdec, peaks)
    if peaks.shape[0]:
        fold_max(at(into, (1,), U(0)), to_float32(peaks.max()))


@numba.njit(cache=True, inline="always", error_model="numpy")
def _both_values_at(vals, m, n):
    """Both usages' operand memory (:func:`_values_at`) and kinds, and ``vdec``, as one tuple."""
    vals_last, kind_last, vals_first, kind_first, vdec = vals
    vf_last, vb_last = _values_at(vals_last, m, n)
    vf_first, vb_first = _values_at(vals_first, m, n)
    return vf_last, vb_last, kind_last, vf_first, vb_first, kind_first, vdec


@numba.njit(cache=True, error_model="numpy")
def quantize_both_blocks_at(x, like, m, n, out_last, out_first, scales_last, scales_first, block, width, rule, enc, vals):
    codes_last, codes_first = at(out_last, (m, n), np.uint8(0)), at(out_first, (m, n), np.uint8(0))
    stored_last, stored_first = _stored_at(scales_last, (m, n // block), rule), _stored_at(scales_first, (m // block, n), rule)
    values = _both_values_at(vals, m, n)
    quantize_both_blocks(at(x, (m, n), like), codes_last, codes_first, stored_last, stored_first, block, width, rule, enc, values)
    _e8m0_codes(stored_last, scales_last, rule)
    _e8m0_codes(stored_first, scales_first, rule)


@numba.njit(cache=True, error_model="numpy")
def quantize_both_rows_at(x, like, m, n, out_last, out_first, scales_last, scales_first, chunks, rule, enc, vals):
    codes_last, codes_first = at(out_last, (m, n), np.uint8(0)), at(out_first, (m, n), np.uint8(0))
    stored_last, stored_first = _stored_at(scales_last, (m, 1), rule), _stored_at(scales_first, (1, n), rule)
    values = _both_values_at(vals, m, n)
    quantize_both_rows(at(x, (m, n), like), codes_last, codes_first, stored_last, stored_first, chunks, rule, enc, values)
    _e8m0_codes(stored_last, scales_last, rule)
    _e8m0_codes(stored_first, scales_first, rule)


@numba.njit(cache=True, error_model="numpy")
def quantize_tensor_at(x, like, m, n, out, rule, enc, vals, vkind, vdec):
    vf, vb = _values_at(vals, m, n)
    return quantize_tensor(at(x, (m, n), like), at(out, (m, n), np.uint8(0)), rule, enc, vf, vb, vkind, vdec)
