"""The numba kernels behind :mod:`.fp4`: 4-bit (E2M1) quantization in groups of 16 (NVFP4)
or 32 (MXFP4) values along either dim and in 16x16 tiles (``nvfp4_2d``), rounded to nearest
even or stochastically from given uniform draws (imported only when numba is). The arithmetic is NUMERICS.md section 6, as
:mod:`fp8train.quant.fp4_quantize` computes it, from the input's bits as
:mod:`.numba_elements` reads them. The transform's kernels, which feed theirs into the
helpers here, are :mod:`.numba_fp4_transform`.

The block-scale arguments (``nvfp4, m = ge / 6, gd, rule, e4m3``) travel inside a task as
one tuple, ``scale`` (a parallel loop takes no nested tuple as argument).
The cast takes ``stochastic`` and ``draws``: one float32 uniform draw per input value in the
2-D view's row-major order (the reference's ``torch.rand`` over its groups view); where
``stochastic`` is false, an empty array (``(0,)``, or ``(M, 0)`` for the 2-D kernels, so that
every slice a kernel takes of it stays in bounds).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange


from .launch import STRIPE_BYTES
from .numba_elements import F, U, at, column_peaks, encode_fp8, group_scale, peak_bits, to_float32
from .numba_fp4_values import E4M3_VALUES, write_values
from .numba_fp8 import max_magnitude

_FLOAT32_MAX = F(np.finfo(np.float32).max)
_E4M3_MAX = F(448.0)
GROUPS_PER_TASK = 256
"""Groups one parallel task quantizes (a few KiB of input)."""

MXFP4, GIVEN_AMAX, COMPUTE_AMAX, AMAX_ONLY = 0, 1, 2, 3
"""The ``mode`` of an entry point by address: MXFP4 (no global scale); NVFP4 under the
float32 global amax stored at ``amax``; NVFP4 under the amax the entry point computes first
(of the input, or with the transform of the transformed values) and stores at ``amax``; that
amax alone, nothing quantized (stochastic rounding draws only once it is known not NaN)."""


@numba.njit(cache=True, inline="always", error_model="numpy")
def _e2m1(v):
    """The E2M1 code of float32 ``v``: round to nearest, ties to even (``>`` past a midpoint
    above an even index, ``>=`` above an odd one); ``|v| > 6`` gives 6 (the clamp), NaN code 0;
    ``v < 0`` sets the sign bit, also where it rounds to zero."""
    a = abs(v)
    index = (
        U(a > F(0.25))
        + U(a >= F(0.75))
        + U(a > F(1.25))
        + U(a >= F(1.75))
        + U(a > F(2.5))
        + U(a >= F(3.5))
        + U(a > F(5.0))
    )
    return np.uint8(index | (U(8) if v < F(0) else U(0)))


@numba.njit(cache=True, inline="always", error_model="numpy")
def _e2m1_stochastic(v, draw):
    """The E2M1 code of float32 ``v`` rounded stochastically, as ``e2m1._round_stochastically``:
    ``|v|`` clamped to 6 lies in ``[lo, hi)`` of the grid; the code of ``hi`` if
    ``draw < (|v| - lo) / (hi - lo)`` (float32, exact), else of ``lo``. NaN: code 0."""
    a = abs(v)
    a = F(6.0) if a > F(6.0) else a
    lower = (
        U(a >= F(0.5))
        + U(a >= F(1.0))
        + U(a >= F(1.5))
        + U(a >= F(2.0))
        + U(a >= F(3.0))
        + U(a >= F(4.0))
        + U(a >= F(6.0))
    )
    # The grid's lower neighbour and the gap above it, by select (no table lookup: vectorizes).
    low = F(lower) * F(0.5) if lower <= U(4) else (F(lower) - F(2.0) if lower <= U(6) else F(6.0))
    gap = F(0.5) if lower <= U(3) else (F(2.0) if lower == U(6) else F(1.0))  # 6 to 6: the clamp, gap 1
    index = U(lower + U(draw < F(F(a - low) / gap)))
    return np.uint8(index | (U(8) if v < F(0) else U(0)))


@numba.njit(cache=True, inline="always", error_model="numpy")
def _pack_row(src, dst, encs, stochastic, draws):
    """``dst[j]``: the codes of ``src[2j] * encs[j]`` (low nibble) and ``src[2j + 1] * encs[j]``
    (one scale per byte of ``dst``, a group's two values share it: a long loop, which vectorizes)."""
    if stochastic:
        for j in range(dst.shape[0]):
            low = _e2m1_stochastic(F(to_float32(src[2 * j]) * encs[j]), draws[2 * j])
            high = _e2m1_stochastic(F(to_float32(src[2 * j + 1]) * encs[j]), draws[2 * j + 1])
            dst[j] = np.uint8(low | (high << np.uint8(4)))
    else:
        for j in range(dst.shape[0]):
            low = _e2m1(F(to_float32(src[2 * j]) * encs[j]))
            high = _e2m1(F(to_float32(src[2 * j + 1]) * encs[j]))
            dst[j] = np.uint8(low | (high << np.uint8(4)))


@numba.njit(cache=True, inline="always", error_model="numpy")
def _pack_rows(low_src, high_src, dst, encs, stochastic, low_draws, high_draws):
    """``dst[j]``: the codes of ``low_src[j] * encs[j]`` (low nibble) and ``high_src[j] * encs[j]``."""
    if stochastic:
        for j in range(dst.shape[0]):
            low = _e2m1_stochastic(F(to_float32(low_src[j]) * encs[j]), low_draws[j])
            high = _e2m1_stochastic(F(to_float32(high_src[j]) * encs[j]), high_draws[j])
            dst[j] = np.uint8(low | (high << np.uint8(4)))
    else:
        for j in range(dst.shape[0]):
            low = _e2m1(F(to_float32(low_src[j]) * encs[j]))
            high = _e2m1(F(to_float32(high_src[j]) * encs[j]))
            dst[j] = np.uint8(low | (high << np.uint8(4)))


@numba.njit(cache=True, inline="always", error_model="numpy")
def _nvfp4_scale(amax, m, gd, e4m3):
    """``(enc, stored E4M3 code)`` of one NVFP4 block from its float32 amax, ``m = ge / 6``
    and ``gd`` (``nvfp4_block_scales``; NaN propagates, min() keeps it)."""
    dec = F(amax * m)
    dec = _FLOAT32_MAX if dec > _FLOAT32_MAX else dec
    dec = _E4M3_MAX if dec > _E4M3_MAX else dec
    code = encode_fp8(dec, e4m3)
    enc = F(F(1.0) / F(E4M3_VALUES[code] * gd))
    return (_FLOAT32_MAX if enc > _FLOAT32_MAX else enc), code


@numba.njit(cache=True, inline="always", error_model="numpy")
def block_scale(amax, scale):
    """``(enc, stored)`` of one block: NVFP4's E4M3 code, else the E8M0 exponent by the rule."""
    nvfp4, m, gd, rule, e4m3 = scale
    if nvfp4:
        return _nvfp4_scale(amax, m, gd, e4m3)
    enc, exponent = group_scale(amax, rule)
    return enc, np.uint8(exponent)


@numba.njit(cache=True, inline="always", error_model="numpy")
def quantize_run(src, data, scales, group, scale, stochastic, draws):
    """Quantize ``src`` (a run of whole groups of ``group`` values, as input bits) into
    ``data`` (two codes a byte) and ``scales`` (one stored scale a group): the scales first,
    then the whole run's codes in one loop. The groups' peaks, their scales and the spread
    of those over the bytes are three loops: the scales' own loop vectorizes (one loop of
    all three per group did not; 256x256 in 1x32 groups, codes only: 35 -> 28 us, issue 38)."""
    half, groups = group // 2, src.shape[0] // group
    peaks = np.empty(groups, dtype=np.float32)
    for g in range(groups):
        peaks[g] = to_float32(peak_bits(src[g * group : (g + 1) * group]))
    group_encs = np.empty(groups, dtype=np.float32)
    for g in range(groups):
        group_encs[g], scales[g] = block_scale(peaks[g], scale)
    encs = np.empty(src.shape[0] // 2, dtype=np.float32)
    for g in range(groups):
        encs[g * half : (g + 1) * half] = group_encs[g]
    _pack_row(src, data, encs, stochastic, draws)


@numba.njit(cache=True, inline="always", error_model="numpy")
def quantize_stripe(src_at, data_at, draws_at, block, width, scales, scale, stochastic):
    """Quantize ``block`` rows by ``width`` columns of ``src`` in groups of ``block`` rows by
    one column: codes into ``block / 2`` rows of ``data`` (row ``2i`` in the low nibble),
    ``scales`` one a column. Each ``*_at`` is ``(array, first row, first column)``: rows are
    sliced from the whole arrays, one at a time, so they keep their unit stride (and the
    loops their vectors)."""
    src, sr, sc = src_at
    data, dr, dc = data_at
    draws, wr, wc = draws_at
    peaks = column_peaks(src, sr, sr + block, sc, sc + width)
    encs = np.empty(width, dtype=np.float32)
    for j in range(width):
        encs[j], scales[j] = block_scale(to_float32(peaks[j]), scale)
    for i in range(block // 2):
        low_src, high_src = src[sr + 2 * i, sc : sc + width], src[sr + 2 * i + 1, sc : sc + width]
        low_draws, high_draws = draws[wr + 2 * i, wc : wc + width], draws[wr + 2 * i + 1, wc : wc + width]
        _pack_rows(low_src, high_src, data[dr + i, dc : dc + width], encs, stochastic, low_draws, high_draws)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_fp4_groups(x, data, scales, group, nvfp4, m, gd, rule, e4m3, stochastic, draws):
    """Quantize the flat ``x`` (float32 or bfloat16 bits) in consecutive groups of ``group``
    values: ``scales[g]`` the stored scale (E4M3 code for NVFP4, else the E8M0 exponent),
    ``data`` the E2M1 codes two a byte (element ``2j`` in the low nibble)."""
    groups = x.shape[0] // group
    half = group // 2
    for task in prange((groups + GROUPS_PER_TASK - 1) // GROUPS_PER_TASK):
        g0, g1 = task * GROUPS_PER_TASK, min(groups, (task + 1) * GROUPS_PER_TASK)
        scale = (nvfp4, m, gd, rule, e4m3)
        run = slice(g0 * group, g1 * group)  # draws: empty without stochastic, so its slice too
        quantize_run(x[run], data[g0 * half : g1 * half], scales[g0:g1], group, scale, stochastic, draws[run])


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_fp4_columns(x, data, scales, block, width, nvfp4, m, gd, rule, e4m3, stochastic, draws):
    """Quantize the 2-D ``x`` (M, K; float32 or bfloat16 bits) in groups of ``block`` rows by
    one column: ``scales`` (M/block, K), ``data`` (M/2, K) with row ``2i`` in the low nibble
    of byte row ``i``. A task takes ``block`` rows by ``width`` columns."""
    rows, n = x.shape
    tasks_per_stripe = (n + width - 1) // width
    for task in prange((rows // block) * tasks_per_stripe):
        stripe, c0 = task // tasks_per_stripe, (task % tasks_per_stripe) * width
        c1 = min(n, c0 + width)
        r0 = stripe * block
        scale = (nvfp4, m, gd, rule, e4m3)
        src_at, data_at, draws_at = (x, r0, c0), (data, r0 // 2, c0), (draws, r0, c0)  # draws: (M, 0) without stochastic
        quantize_stripe(src_at, data_at, draws_at, block, c1 - c0, scales[stripe, c0:c1], scale, stochastic)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_fp4_tiles(x, data, scales, tile, width, nvfp4, m, gd, rule, e4m3, stochastic, draws):
    """Quantize the 2-D ``x`` (M, K; float32 or bfloat16 bits) in ``tile x tile`` blocks:
    ``scales`` (M/tile, K/tile), ``data`` (M, K/2) packed along the rows. A task takes
    ``tile`` rows by ``width`` columns (whole tiles)."""
    rows, n = x.shape
    tasks_per_stripe = (n + width - 1) // width
    for task in prange((rows // tile) * tasks_per_stripe):
        stripe, c0 = task // tasks_per_stripe, (task % tasks_per_stripe) * width
        c1 = min(n, c0 + width)
        peaks = column_peaks(x, stripe * tile, (stripe + 1) * tile, c0, c1)
        scale = (nvfp4, m, gd, rule, e4m3)
        encs = np.empty((c1 - c0) // 2, dtype=np.float32)  # one a byte
        for t in range((c1 - c0) // tile):
            amax = to_float32(peak_bits(peaks[t * tile : (t + 1) * tile]))
            enc, scales[stripe, c0 // tile + t] = block_scale(amax, scale)
            encs[t * tile // 2 : (t + 1) * tile // 2] = enc
        for i in range(stripe * tile, (stripe + 1) * tile):
            _pack_row(x[i, c0:c1], data[i, c0 // 2 : c1 // 2], encs, stochastic, draws[i, c0:c1])


@numba.njit(cache=True, inline="always", error_model="numpy")
def global_scales(amax, mode):
    """``(go on, m = ge / 6, gd)`` from the float32 global amax ``amax[0]`` as
    ``nvfp4_global_scales`` computes them (``ge = min(2688 / amax, FLT_MAX)``, 1 where 0;
    ``gd = 1 / ge``); go on: quantize (not :data:`AMAX_ONLY`, the amax not NaN). MXFP4: 1, 1."""
    if mode == MXFP4:
        return True, F(1.0), F(1.0)
    ge = F(F(2688.0) / amax[0])
    ge = _FLOAT32_MAX if ge > _FLOAT32_MAX else ge
    ge = F(1.0) if ge == F(0) else ge
    return (mode != AMAX_ONLY and amax[0] == amax[0]), F(ge * F(1.0 / 6.0)), F(F(1.0) / ge)


@numba.njit(cache=True, inline="always", error_model="numpy")
def input_amax(x, amax, mode):
    """With :data:`COMPUTE_AMAX` or :data:`AMAX_ONLY`, store ``max |x|`` (float32; NaN if
    any is) at ``amax[0]``; returns the ``global_scales``."""
    if mode >= COMPUTE_AMAX:
        amax[0] = to_float32(max_magnitude(x))
    return global_scales(amax, mode)


@numba.njit(cache=True, inline="always", error_model="numpy")
def stripe_width(k, rows, itemsize):
    """Columns one task of a striped kernel takes (``rows`` rows): about ``STRIPE_BYTES`` of
    input, a multiple of 16 (whole 16x16 tiles), at least 16, at most all."""
    return min(k, max(16, STRIPE_BYTES // (rows * itemsize) // 16 * 16))


# Entry points by address (:func:`.numba_elements.at`): the kernels above on contiguous
# tensors' memory, one signature for all (:mod:`.numba_fp4_transform`'s too). ``x`` is
# ``m x k``, read as the bits of ``like``'s dtype; ``data`` and ``scales`` are uint8 in the
# shapes the kernels above write; ``draws`` is float32 ``m x k`` with ``stochastic`` (else
# not read: any address); ``amax`` a float32 (any address for MXFP4), ``mode`` what it is
# (:data:`MXFP4`...); ``block`` the group's values along the axis (or the tile's side);
# ``round_to`` the transform's rounding (unused here). Each returns whether the global amax
# is not NaN (MXFP4: true); only then, and not with :data:`AMAX_ONLY`, has it quantized;
# then, where ``values`` is not 0, it writes the GEMM operand there (:func:`write_values`).


@numba.njit(cache=True, error_model="numpy")
def quantize_fp4_groups_at(x, like, m, k, data, scales, draws, amax, mode, block, round_to, rule, e4m3, stochastic, values, bf16):
    stored_amax = at(amax, (1,), np.float32(0))
    go, ge6, gd = input_amax(at(x, (m, k), like), stored_amax, mode)
    if go:
        codes, stored = at(data, (m * k // 2,), np.uint8(0)), at(scales, (m * k // block,), np.uint8(0))
        uniform = at(draws, (m * k if stochastic else 0,), np.float32(0))
        scale = (mode != MXFP4, ge6, gd, rule, e4m3)
        quantize_fp4_groups(at(x, (m * k,), like), codes, stored, block, *scale, stochastic, uniform)
        codes_2d, stored_2d = at(data, (m, k // 2), np.uint8(0)), at(scales, (m, k // block), np.uint8(0))
        write_values(values, bf16, codes_2d, False, stored_2d, False, 1, block, mode != MXFP4)
    return mode == MXFP4 or stored_amax[0] == stored_amax[0]


@numba.njit(cache=True, error_model="numpy")
def quantize_fp4_columns_at(x, like, m, k, data, scales, draws, amax, mode, block, round_to, rule, e4m3, stochastic, values, bf16):
    source, stored_amax = at(x, (m, k), like), at(amax, (1,), np.float32(0))
    go, ge6, gd = input_amax(source, stored_amax, mode)
    if go:
        codes, stored = at(data, (m // 2, k), np.uint8(0)), at(scales, (m // block, k), np.uint8(0))
        uniform = at(draws, (m, k if stochastic else 0), np.float32(0))
        scale = (mode != MXFP4, ge6, gd, rule, e4m3)
        width = stripe_width(k, block, source.itemsize)
        quantize_fp4_columns(source, codes, stored, block, width, *scale, stochastic, uniform)
        write_values(values, bf16, codes, True, stored, True, 1, block, mode != MXFP4)
    return mode == MXFP4 or stored_amax[0] == stored_amax[0]


@numba.njit(cache=True, error_model="numpy")
def quantize_fp4_tiles_at(x, like, m, k, data, scales, draws, amax, mode, block, round_to, rule, e4m3, stochastic, values, bf16):
    source, stored_amax = at(x, (m, k), like), at(amax, (1,), np.float32(0))
    go, ge6, gd = input_amax(source, stored_amax, mode)
    if go:
        codes, stored = at(data, (m, k // 2), np.uint8(0)), at(scales, (m // block, k // block), np.uint8(0))
        uniform = at(draws, (m, k if stochastic else 0), np.float32(0))
        scale = (mode != MXFP4, ge6, gd, rule, e4m3)
        width = stripe_width(k, block, source.itemsize)
        quantize_fp4_tiles(source, codes, stored, block, width, *scale, stochastic, uniform)
        write_values(values, bf16, codes, False, stored, False, block, block, mode != MXFP4)
    return mode == MXFP4 or stored_amax[0] == stored_amax[0]
