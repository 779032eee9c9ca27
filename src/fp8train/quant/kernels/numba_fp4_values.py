"""The numba kernel behind :func:`.operands.try_fp4_operand_values`: a K-last
4-bit operand's packed E2M1 codes to its values with the block scales folded in, in one
pass, from the stored scale codes (imported only when numba is). The PyTorch ops of
:func:`fp8train.quant.gemm.fp4.fp4_operand_values` are the reference: the same float32
products (exact), so the same bits.

An E2M1 code's value is computed, not looked up: its exponent and mantissa fields shifted
into float32's (bits 23-24 and 22) are the value times 2^-126, exactly (code 1, 0.5, as a
float32 subnormal), and one multiply by 2^126 restores it; so a row's codes become values
in vectors. The two values of a byte are written as one word (float32's pair, or
bfloat16's).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from .numba_elements import F, U, at

ROWS_PER_TASK = 64
"""Output rows one parallel task fills."""

_U64 = np.uint64


@numba.njit(cache=True, inline="always", error_model="numpy")
def e2m1_value(code):
    """The float32 value of the E2M1 ``code`` (its low 4 bits; uint32), exactly."""
    fields = U(U(code & U(7)) << U(22))
    return F(U(fields | U(U(code & U(8)) << U(28))).view(F) * F(2.0**126))


def _pair(low, high, out):
    """The word of ``out``'s dtype holding float32 ``low`` then ``high``: uint64 (the float32
    bits of both) or uint32 (their upper halves: bfloat16, exact for these values)."""


@overload(_pair, inline="always")
def _pair_impl(low, high, out):
    if out.dtype == types.uint64:
        return lambda low, high, out: _U64(_U64(F(low).view(U)) | _U64(_U64(F(high).view(U)) << _U64(32)))
    if out.dtype == types.uint32:
        return lambda low, high, out: U(U(F(low).view(U) >> U(16)) | U(U(F(high).view(U) >> U(16)) << U(16)))
    return None


@numba.njit(cache=True, inline="always", error_model="numpy")
def _fold_row(src, dst, byte_scales):
    """``dst[j]``: the values of ``src[j]``'s two codes (low nibble first) times
    ``byte_scales[j]``: one long loop, which vectorizes."""
    for j in range(src.shape[0]):
        byte, scale = U(src[j]), byte_scales[j]
        low = F(e2m1_value(U(byte & U(15))) * scale)
        high = F(e2m1_value(U(byte >> U(4))) * scale)
        dst[j] = _pair(low, high, dst)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def fold_fp4_values(packed, transposed, scales, scales_transposed, group_rows, group_cols, scale_values, out):
    """``out[r, c] = value(code(r, c)) * scale_values[scales[r // group_rows, c // group_cols]]``
    (float32 product; exact), two values a word.

    Args:
        packed: uint8 codes, two a byte: ``[rows, K/2]`` (element ``2j`` of a row in the low
            nibble of byte ``j``), or with ``transposed`` its transpose ``[K/2, rows]``
            stored contiguously (an ``axis=0`` tensor's bytes, read as its K-last transpose).
        scales: the stored scale codes (uint8) ``[rows / group_rows, K / group_cols]``, or
            with ``scales_transposed`` its transpose stored contiguously.
        group_rows, group_cols: one scale's rows and columns (``group_cols`` even).
        scale_values: float32 ``[256]``, the value of every scale code (E4M3 or E8M0).
        out: ``[rows, K/2]`` words: uint64 (float32 pairs) or uint32 (bfloat16 pairs).
    """
    rows, half = out.shape
    words = group_cols // 2  # bytes a scale covers along a row
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0, r1 = task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)
        # Transposed codes are read a column at a time into rows (contiguous reads).
        buffer = np.empty((r1 - r0, half if transposed else 0), dtype=np.uint8)
        for j in range(buffer.shape[1]):
            column = packed[j, r0:r1]
            for r in range(r1 - r0):
                buffer[r, j] = column[r]
        byte_scales = np.empty(half, dtype=np.float32)
        for r in range(r0, r1):
            scale_row = r // group_rows
            for g in range(half // words):
                scale = scale_values[scales[g, scale_row] if scales_transposed else scales[scale_row, g]]
                for j in range(words):
                    byte_scales[g * words + j] = scale
            _fold_row(buffer[r - r0] if transposed else packed[r], out[r], byte_scales)


@numba.njit(cache=True, error_model="numpy")
def fold_fp4_values_at(packed, transposed, scales, scales_transposed, group_rows, group_cols, scale_values, out, rows, k, like):
    """:func:`fold_fp4_values` by address (:func:`.numba_elements.at`): the packed codes
    (``[rows, K/2]``, or ``[K/2, rows]`` with ``transposed``), the scale codes (likewise)
    and ``out`` ``[rows, K]`` of float32 (``like`` uint64) or bfloat16 (``like`` uint32)."""
    codes = at(packed, (k // 2, rows) if transposed else (rows, k // 2), np.uint8(0))
    shape = (k // group_cols, rows // group_rows) if scales_transposed else (rows // group_rows, k // group_cols)
    stored = at(scales, shape, np.uint8(0))
    fold_fp4_values(codes, transposed, stored, scales_transposed, group_rows, group_cols, scale_values, at(out, (rows, k // 2), like))
