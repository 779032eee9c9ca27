"""The numba kernels of NVFP4's random Hadamard transform fused with its quantization
(:mod:`.fp4`; imported only when numba is): each task transforms its
runs of 16 values into a small buffer, as :func:`fp8train.quant.hadamard.random_hadamard_transform`
computes them (``y_j = sum_i x_i H[i][j]``, float32 products and sums in index order, rounded
once to the input's dtype), and quantizes the buffer with the helpers of
:mod:`.numba_fp4`. The NVFP4 global amax is over the transformed
tensor, so a first pass computes it (transforming, not storing).

``dtype`` says how a transformed value is rounded: 0 float32 (not at all), 1 bfloat16,
2 float16, each to nearest even; the buffer holds the float32 bits of the rounded values,
which the helpers read as they read a float32 input.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..hadamard import hadamard_matrix
from .numba_fp4 import COMPUTE_AMAX, GROUPS_PER_TASK, MXFP4, global_scales, quantize_stripe, stripe_width
from .numba_fp4_values import write_values
from .numba_elements import F, U, at, bfloat16_bits, peak_bits, to_float32

RHT_SIZE = 16
KEEP_LIMIT = 1 << 20
"""The most values whose transform a launch keeps between its amax's pass and its quantization
(4 MiB), rather than computing it twice."""
_H = hadamard_matrix().numpy().astype(np.float32)  # entries +-1/4: a product is exact
_SIGN = U(0x80000000)
_FLOAT16_OVERFLOW = F(65520.0)  # halfway between float16's max (65504) and 2^16: ties go up
_FLOAT16_MIN_NORMAL = F(2.0**-14)


@numba.njit(cache=True, error_model="numpy")
def _float16_value(y):
    """float32 ``y`` rounded to float16, nearest even, as float32: normal values by their
    bits; subnormals by adding 0.5, whose float32 ulp is float16's subnormal step (2^-24);
    past 65520, infinity; NaN as it is."""
    bits = F(y).view(U)
    a = abs(y)
    normal = U(U(U(bits & U(0x7FFFFFFF)) + U(0xFFF) + U(U(bits >> U(13)) & U(1))) & U(0x7FFFE000))
    subnormal = F(F(a + F(0.5)) - F(0.5)).view(U)
    magnitude = subnormal if a < _FLOAT16_MIN_NORMAL else normal
    magnitude = U(0x7F800000) if a >= _FLOAT16_OVERFLOW else magnitude
    return y if a != a else U(magnitude | U(bits & _SIGN)).view(F)


@numba.njit(cache=True, error_model="numpy")
def _round_into(values, dst, dtype):
    """``dst`` (uint32): the float32 bits of float32 ``values`` rounded to ``dtype`` (0 float32,
    1 bfloat16, 2 float16). One loop per dtype, so that each vectorizes."""
    if dtype == 1:
        for c in range(values.shape[0]):
            dst[c] = U(U(bfloat16_bits(values[c])) << U(16))
    elif dtype == 2:
        for c in range(values.shape[0]):
            dst[c] = F(_float16_value(values[c])).view(U)
    else:
        for c in range(values.shape[0]):
            dst[c] = F(values[c]).view(U)


@numba.njit(cache=True, error_model="numpy")
def _transform_runs(src, out, dtype):
    """``out`` (16, R; float32 bits): column ``r`` the transform of run ``r`` of the flat
    ``src`` (R runs of 16, input bits). The runs are turned into columns first, so that the
    sums run down columns, one vector of runs at a time, as in :func:`_transform_columns`."""
    runs = np.empty((RHT_SIZE, src.shape[0] // RHT_SIZE), dtype=src.dtype)
    for r in range(runs.shape[1]):
        for i in range(RHT_SIZE):
            runs[i, r] = src[r * RHT_SIZE + i]
    _transform_columns(runs, 0, 0, runs.shape[1], out, dtype)


@numba.njit(cache=True, error_model="numpy")
def _transform_columns(x, r0, c0, c1, out, dtype):
    """``out`` (16, c1 - c0; float32 bits): the columns of ``x[r0 : r0 + 16, c0:c1]``
    transformed (a run is 16 rows of one column); float32 sums in a row of ``acc``."""
    acc = np.empty(c1 - c0, dtype=np.float32)
    for j in range(RHT_SIZE):
        first = x[r0, c0:c1]
        for c in range(acc.shape[0]):
            acc[c] = F(to_float32(first[c]) * _H[0, j])
        for i in range(1, RHT_SIZE):
            row, h = x[r0 + i, c0:c1], _H[i, j]
            for c in range(acc.shape[0]):
                acc[c] = F(acc[c] + F(to_float32(row[c]) * h))
        _round_into(acc, out[j], dtype)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def rht_peak_runs(x, dtype):
    """The largest magnitude bits (float32's) of the transform of the flat ``x`` by runs of 16."""
    runs = x.shape[0] // RHT_SIZE
    tasks = (runs + GROUPS_PER_TASK - 1) // GROUPS_PER_TASK
    peaks = np.zeros(tasks, dtype=np.uint32)
    for task in prange(tasks):
        r0, r1 = task * GROUPS_PER_TASK, min(runs, (task + 1) * GROUPS_PER_TASK)
        out = np.empty((RHT_SIZE, r1 - r0), dtype=np.uint32)
        _transform_runs(x[r0 * RHT_SIZE : r1 * RHT_SIZE], out, dtype)
        peaks[task] = peak_bits(out.reshape(-1))
    return peaks.max()


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def rht_peak_columns(x, width, dtype, kept):
    """The largest magnitude bits of the transform of the 2-D ``x`` by runs of 16 rows; the
    transform kept in ``kept`` (its float32 bits, ``x``'s shape) unless that is ``(M, 0)``."""
    rows, n = x.shape
    tasks_per_stripe = (n + width - 1) // width
    peaks = np.zeros((rows // RHT_SIZE) * tasks_per_stripe, dtype=np.uint32)
    for task in prange(peaks.shape[0]):
        stripe, c0 = task // tasks_per_stripe, (task % tasks_per_stripe) * width
        c1 = min(n, c0 + width)
        out = np.empty((RHT_SIZE, c1 - c0), dtype=np.uint32)
        _transform_columns(x, stripe * RHT_SIZE, c0, c1, out, dtype)
        peaks[task] = peak_bits(out.reshape(-1))
        for j in range(RHT_SIZE if kept.shape[1] else 0):
            kept[stripe * RHT_SIZE + j, c0:c1] = out[j]
    return peaks.max()


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_rht_runs(x, data, scales, dtype, nvfp4, m, gd, rule, e4m3, stochastic, draws):
    """The transform of the flat ``x`` by runs of 16, quantized in NVFP4 groups of 16 (as
    ``quantize_fp4_groups``: ``data`` two codes a byte, ``scales`` one E4M3 code a group).
    A task's runs are columns of its buffer: it quantizes them as ``quantize_fp4_columns``
    does, and writes each column's 8 bytes back in a row."""
    runs = x.shape[0] // RHT_SIZE
    half = RHT_SIZE // 2
    for task in prange((runs + GROUPS_PER_TASK - 1) // GROUPS_PER_TASK):
        r0, r1 = task * GROUPS_PER_TASK, min(runs, (task + 1) * GROUPS_PER_TASK)
        out = np.empty((RHT_SIZE, r1 - r0), dtype=np.uint32)
        _transform_runs(x[r0 * RHT_SIZE : r1 * RHT_SIZE], out, dtype)
        column_draws = np.empty((RHT_SIZE, (r1 - r0) if stochastic else 0), dtype=np.float32)
        for r in range(column_draws.shape[1]):
            for i in range(RHT_SIZE):
                column_draws[i, r] = draws[(r0 + r) * RHT_SIZE + i]
        column_data = np.empty((half, r1 - r0), dtype=np.uint8)
        scale = (nvfp4, m, gd, rule, e4m3)
        src_at, data_at, draws_at = (out, 0, 0), (column_data, 0, 0), (column_draws, 0, 0)
        quantize_stripe(src_at, data_at, draws_at, RHT_SIZE, r1 - r0, scales[r0:r1], scale, stochastic)
        for r in range(r1 - r0):
            for i in range(half):
                data[(r0 + r) * half + i] = column_data[i, r]


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_rht_columns(x, data, scales, width, dtype, nvfp4, m, gd, rule, e4m3, stochastic, draws, kept):
    """The transform of the 2-D ``x`` by runs of 16 rows, quantized in NVFP4 groups of 16 rows
    by one column (as ``quantize_fp4_columns``), read from ``kept`` where the amax's pass
    kept it (else ``(M, 0)``: computed again). A task takes 16 rows by ``width`` columns."""
    rows, n = x.shape
    tasks_per_stripe = (n + width - 1) // width
    for task in prange((rows // RHT_SIZE) * tasks_per_stripe):
        stripe, c0 = task // tasks_per_stripe, (task % tasks_per_stripe) * width
        c1 = min(n, c0 + width)
        r0 = stripe * RHT_SIZE
        scale = (nvfp4, m, gd, rule, e4m3)
        if kept.shape[1]:
            src_at = (kept, r0, c0)
        else:
            out = np.empty((RHT_SIZE, c1 - c0), dtype=np.uint32)
            _transform_columns(x, r0, c0, c1, out, dtype)
            src_at = (out, 0, 0)
        data_at, draws_at = (data, r0 // 2, c0), (draws, r0, c0)  # draws: (M, 0) without stochastic
        quantize_stripe(src_at, data_at, draws_at, RHT_SIZE, c1 - c0, scales[stripe, c0:c1], scale, stochastic)


# Entry points by address, with :mod:`.numba_fp4`'s signature: NVFP4 groups of 16 along the
# rows (``runs``) or down the columns; the global amax computed is the transformed values';
# ``round_to`` is the transform's rounding (``dtype`` above), ``block`` unused (16).


@numba.njit(cache=True, error_model="numpy")
def quantize_rht_runs_at(x, like, m, k, data, scales, draws, amax, mode, block, round_to, rule, e4m3, stochastic, values, bf16):
    source, stored_amax = at(x, (m * k,), like), at(amax, (1,), np.float32(0))
    if mode >= COMPUTE_AMAX:
        stored_amax[0] = U(rht_peak_runs(source, round_to)).view(F)
    go, ge6, gd = global_scales(stored_amax, mode)
    if go:
        codes, stored = at(data, (m * k // 2,), np.uint8(0)), at(scales, (m * k // RHT_SIZE,), np.uint8(0))
        uniform = at(draws, (m * k if stochastic else 0,), np.float32(0))
        scale = (mode != MXFP4, ge6, gd, rule, e4m3)
        quantize_rht_runs(source, codes, stored, round_to, *scale, stochastic, uniform)
        codes_2d, stored_2d = at(data, (m, k // 2), np.uint8(0)), at(scales, (m, k // RHT_SIZE), np.uint8(0))
        write_values(values, bf16, codes_2d, False, stored_2d, False, 1, RHT_SIZE, True)
    return mode == MXFP4 or stored_amax[0] == stored_amax[0]


@numba.njit(cache=True, error_model="numpy")
def quantize_rht_columns_at(x, like, m, k, data, scales, draws, amax, mode, block, round_to, rule, e4m3, stochastic, values, bf16):
    source, stored_amax = at(x, (m, k), like), at(amax, (1,), np.float32(0))
    width = stripe_width(k, RHT_SIZE, source.itemsize)
    # Computed in one launch, the amax's pass keeps the transform for the quantization (up to
    # KEEP_LIMIT values: the memory of a float32 copy).
    kept = np.empty((m, k if mode == COMPUTE_AMAX and m * k <= KEEP_LIMIT else 0), dtype=np.uint32)
    if mode >= COMPUTE_AMAX:
        stored_amax[0] = U(rht_peak_columns(source, width, round_to, kept)).view(F)
    go, ge6, gd = global_scales(stored_amax, mode)
    if go:
        codes, stored = at(data, (m // 2, k), np.uint8(0)), at(scales, (m // RHT_SIZE, k), np.uint8(0))
        uniform = at(draws, (m, k if stochastic else 0), np.float32(0))
        scale = (mode != MXFP4, ge6, gd, rule, e4m3)
        quantize_rht_columns(source, codes, stored, width, round_to, *scale, stochastic, uniform, kept)
        write_values(values, bf16, codes, True, stored, True, 1, RHT_SIZE, True)
    return mode == MXFP4 or stored_amax[0] == stored_amax[0]
