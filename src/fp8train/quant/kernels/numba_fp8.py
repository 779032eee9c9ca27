"""The numba kernels behind :mod:`.fp8`: FP8 quantization of a 2-D input's bits in groups
of one row, of strided rows (stripes), of whole columns, of the whole tensor, and both
usages of one tensor from one read; and the tensor's amax (imported only when numba is).
The arithmetic of one element and one group is :mod:`.numba_elements`'s.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .numba_elements import F, at, column_peaks, encode_fp8, group_scale, magnitude_bits, peak_bits, to_float32


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


# Entry points by address (:func:`.numba_elements.at`): the kernels above on contiguous
# tensors' memory, ``x`` an ``m x n`` input read as the bits of ``like``'s dtype, the
# outputs uint8 codes and float32 scales in the shapes the kernels above write.


@numba.njit(cache=True, error_model="numpy")
def quantize_row_groups_at(x, like, m, n, out, scales, cols, rule, enc):
    codes, stored = at(out, (m, n), np.uint8(0)), at(scales, (m, n // cols), np.float32(0))
    quantize_row_groups(at(x, (m, n), like), codes, stored, cols, rule, enc)


@numba.njit(cache=True, error_model="numpy")
def quantize_stripe_groups_at(x, like, m, n, out, scales, rows, cols, width, rule, enc):
    codes, stored = at(out, (m, n), np.uint8(0)), at(scales, (m // rows, n // cols), np.float32(0))
    quantize_stripe_groups(at(x, (m, n), like), codes, stored, rows, cols, width, rule, enc)


@numba.njit(cache=True, error_model="numpy")
def quantize_column_groups_at(x, like, m, n, out, scales, chunks, rule, enc):
    codes, stored = at(out, (m, n), np.uint8(0)), at(scales, (1, n), np.float32(0))
    quantize_column_groups(at(x, (m, n), like), codes, stored, chunks, rule, enc)


@numba.njit(cache=True, error_model="numpy")
def max_magnitude_at(x, like, m, n):
    return max_magnitude(at(x, (m, n), like))


@numba.njit(cache=True, error_model="numpy")
def cast_scaled_at(x, like, m, n, out, scale, enc):
    cast_scaled(at(x, (m, n), like), at(out, (m, n), np.uint8(0)), scale, enc)


@numba.njit(cache=True, error_model="numpy")
def quantize_both_blocks_at(x, like, m, n, out_last, out_first, scales_last, scales_first, block, width, rule, enc):
    codes_last, codes_first = at(out_last, (m, n), np.uint8(0)), at(out_first, (m, n), np.uint8(0))
    stored_last = at(scales_last, (m, n // block), np.float32(0))
    stored_first = at(scales_first, (m // block, n), np.float32(0))
    quantize_both_blocks(at(x, (m, n), like), codes_last, codes_first, stored_last, stored_first, block, width, rule, enc)


@numba.njit(cache=True, error_model="numpy")
def quantize_both_rows_at(x, like, m, n, out_last, out_first, scales_last, scales_first, chunks, rule, enc):
    codes_last, codes_first = at(out_last, (m, n), np.uint8(0)), at(out_first, (m, n), np.uint8(0))
    stored_last, stored_first = at(scales_last, (m, 1), np.float32(0)), at(scales_first, (1, n), np.float32(0))
    quantize_both_rows(at(x, (m, n), like), codes_last, codes_first, stored_last, stored_first, chunks, rule, enc)


@numba.njit(cache=True, error_model="numpy")
def quantize_tensor_at(x, like, m, n, out, rule, enc):
    return quantize_tensor(at(x, (m, n), like), at(out, (m, n), np.uint8(0)), rule, enc)
