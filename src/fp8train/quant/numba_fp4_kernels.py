"""The numba kernels behind :mod:`fp8train.quant.fp4_kernels`: 4-bit (E2M1) quantization in
groups of 16 (NVFP4) or 32 (MXFP4) values along either dim, round to nearest even, no
transform (imported only when numba is). The arithmetic is NUMERICS.md section 6,
as :mod:`fp8train.quant.fp4_quantize` computes it, from the input's bits as
:mod:`fp8train.quant.numba_kernels` reads them.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .numba_kernels import F, U, column_peaks, encode_fp8, group_scale, peak_bits, to_float32

_FLOAT32_MAX = F(np.finfo(np.float32).max)
_E4M3_MAX = F(448.0)
GROUPS_PER_TASK = 256
"""Groups one parallel task quantizes (a few KiB of input)."""


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
def _nvfp4_scale(amax, m, gd, e4m3, e4m3_values):
    """``(enc, stored E4M3 code)`` of one NVFP4 block from its float32 amax, ``m = ge / 6``
    and ``gd`` (``nvfp4_block_scales``; NaN propagates, min() keeps it)."""
    dec = F(amax * m)
    dec = _FLOAT32_MAX if dec > _FLOAT32_MAX else dec
    dec = _E4M3_MAX if dec > _E4M3_MAX else dec
    code = encode_fp8(dec, e4m3)
    enc = F(F(1.0) / F(e4m3_values[code] * gd))
    return (_FLOAT32_MAX if enc > _FLOAT32_MAX else enc), code


@numba.njit(cache=True, inline="always", error_model="numpy")
def _block_scale(amax, nvfp4, m, gd, rule, e4m3, e4m3_values):
    """``(enc, stored)`` of one block: NVFP4's E4M3 code, else the E8M0 exponent by ``rule``."""
    if nvfp4:
        return _nvfp4_scale(amax, m, gd, e4m3, e4m3_values)
    enc, exponent = group_scale(amax, rule)
    return enc, np.uint8(exponent)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_fp4_groups(x, data, scales, group, nvfp4, m, gd, rule, e4m3, e4m3_values):
    """Quantize the flat ``x`` (float32 or bfloat16 bits) in consecutive groups of ``group``
    values: ``scales[g]`` the stored scale (E4M3 code for ``nvfp4``, else the E8M0 exponent
    by ``rule``), ``data`` the E2M1 codes two a byte (element ``2j`` in the low nibble)."""
    groups = x.shape[0] // group
    half = group // 2
    for task in prange((groups + GROUPS_PER_TASK - 1) // GROUPS_PER_TASK):
        for g in range(task * GROUPS_PER_TASK, min(groups, (task + 1) * GROUPS_PER_TASK)):
            src = x[g * group : (g + 1) * group]
            enc, scales[g] = _block_scale(to_float32(peak_bits(src)), nvfp4, m, gd, rule, e4m3, e4m3_values)
            dst = data[g * half : (g + 1) * half]
            for j in range(half):
                low = _e2m1(F(to_float32(src[2 * j]) * enc))
                high = _e2m1(F(to_float32(src[2 * j + 1]) * enc))
                dst[j] = np.uint8(low | (high << np.uint8(4)))


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_fp4_columns(x, data, scales, block, width, nvfp4, m, gd, rule, e4m3, e4m3_values):
    """Quantize the 2-D ``x`` (M, K; float32 or bfloat16 bits) in groups of ``block`` rows by
    one column: ``scales`` (M/block, K), ``data`` (M/2, K) with row ``2i`` in the low nibble
    of byte row ``i``. A task takes ``block`` rows by ``width`` columns."""
    rows, n = x.shape
    tasks_per_stripe = (n + width - 1) // width
    for task in prange((rows // block) * tasks_per_stripe):
        stripe, c0 = task // tasks_per_stripe, (task % tasks_per_stripe) * width
        c1 = min(n, c0 + width)
        peaks = column_peaks(x, stripe * block, (stripe + 1) * block, c0, c1)
        encs = np.empty(c1 - c0, dtype=np.float32)
        for j in range(c1 - c0):
            amax = to_float32(peaks[j])
            encs[j], scales[stripe, c0 + j] = _block_scale(amax, nvfp4, m, gd, rule, e4m3, e4m3_values)
        for i in range(stripe * block // 2, (stripe + 1) * block // 2):
            _pack_rows(x[2 * i, c0:c1], x[2 * i + 1, c0:c1], data[i, c0:c1], encs)


@numba.njit(cache=True, inline="always", error_model="numpy")
def _pack_rows(low_src, high_src, dst, encs):
    for j in range(dst.shape[0]):
        low = _e2m1(F(to_float32(low_src[j]) * encs[j]))
        high = _e2m1(F(to_float32(high_src[j]) * encs[j]))
        dst[j] = np.uint8(low | (high << np.uint8(4)))
