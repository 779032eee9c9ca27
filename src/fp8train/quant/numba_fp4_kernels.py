"""The numba kernels behind :mod:`fp8train.quant.fp4_kernels`: 4-bit (E2M1) quantization in
groups of one row by 16 (NVFP4) or 32 (MXFP4) values along the last dim, round to nearest
even, no transform (imported only when numba is). The arithmetic is NUMERICS.md section 6,
as :mod:`fp8train.quant.fp4_quantize` computes it, from the input's bits as
:mod:`fp8train.quant.numba_kernels` reads them.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .numba_kernels import F, U, encode_fp8, group_scale, magnitude_bits, peak_bits, to_float32

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
            amax = to_float32(peak_bits(src))
            if nvfp4:
                enc, stored = _nvfp4_scale(amax, m, gd, e4m3, e4m3_values)
            else:
                enc, exponent = group_scale(amax, rule)
                stored = np.uint8(exponent)
            scales[g] = stored
            dst = data[g * half : (g + 1) * half]
            for j in range(half):
                low = _e2m1(F(to_float32(src[2 * j]) * enc))
                high = _e2m1(F(to_float32(src[2 * j + 1]) * enc))
                dst[j] = np.uint8(low | (high << np.uint8(4)))
