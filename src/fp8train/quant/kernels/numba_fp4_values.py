"""The numba kernel behind :func:`.operands.try_fp4_operand_values`: a K-last
4-bit operand's packed E2M1 codes to its values with the block scales folded in, in one
pass, from the stored scale codes (imported only when numba is). The PyTorch ops of
:func:`fp8train.quant.gemm.fp4.fp4_operand_values` are the reference: the same float32
products (exact), so the same bits.

An E2M1 code's value is computed, not looked up: its exponent and mantissa fields shifted
into float32's (bits 23-24 and 22) are the value times 2^-126, exactly (code 1, 0.5, as a
float32 subnormal), and one multiply by 2^126 restores it; so a row's codes become values
in vectors. The two values of a byte are stored one after the other (float32, or
bfloat16's bits: 2x faster than one word of both, whose packing the loop did not vectorize).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from .numba_elements import F, U, at

ROWS_PER_TASK = 64
"""Output rows one parallel task fills."""
E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
"""The float32 value of every E4M3 code, as PyTorch decodes it (0x7F and 0xFF: NaN)."""
_CODES = np.arange(256, dtype=np.uint32)
E8M0_VALUES = (_CODES << 23 | np.where((_CODES == 0) | (_CODES == 255), 0x400000, 0)).astype(np.uint32).view(np.float32)
"""The float32 value of every E8M0 code, as ``cast.e8m0_float32_bits`` gives its bits (code 0:
the subnormal 2^-127; 0xFF: NaN)."""



@numba.njit(cache=True, inline="always", error_model="numpy")
def e2m1_value(code):
    """The float32 value of the E2M1 ``code`` (its low 4 bits; uint32), exactly."""
    fields = U(U(code & U(7)) << U(22))
    return F(U(fields | U(U(code & U(8)) << U(28))).view(F) * F(2.0**126))


def _element(value, out):
    """Float32 ``value`` as an element of ``out``: float32 itself, or uint16 (its upper half:
    bfloat16, exact for these values)."""


@overload(_element, inline="always")
def _element_impl(value, out):
    if out.dtype == types.float32:
        return lambda value, out: F(value)
    if out.dtype == types.uint16:
        return lambda value, out: np.uint16(U(F(value).view(U) >> U(16)))
    return None


@numba.njit(cache=True, inline="always", error_model="numpy")
def _fold_row(src, dst, byte_scales):
    """``dst[2j]``, ``dst[2j + 1]``: the values of ``src[j]``'s two codes (low nibble first)
    times ``byte_scales[j]``: one long loop, which vectorizes."""
    for j in range(src.shape[0]):
        byte, scale = U(src[j]), byte_scales[j]
        dst[2 * j] = _element(F(e2m1_value(U(byte & U(15))) * scale), dst)
        dst[2 * j + 1] = _element(F(e2m1_value(U(byte >> U(4))) * scale), dst)


def _fold_signature(out_element):
    """:func:`fold_fp4_values`' one signature per output element type (float32, uint16)."""
    codes = types.Array(types.uint8, 2, "C")
    table = types.Array(types.float32, 1, "C", readonly=True)
    return types.void(codes, types.boolean, codes, types.boolean, types.int64, types.int64, table, types.Array(out_element, 2, "C"))


# Its two signatures, declared: every caller's constants (a literal axis, group or flag) and
# its tables (read-only globals, or arrays passed in) take one of these two compiled variants,
# where numba compiled one per combination of literals it was called with (14 in the test
# suite, each a parallel kernel's compile on a fresh checkout).
@numba.njit(
    [_fold_signature(types.float32), _fold_signature(types.uint16)], parallel=True, cache=True, boundscheck=False, error_model="numpy"
)
def fold_fp4_values(packed, transposed, scales, scales_transposed, group_rows, group_cols, scale_values, out):
    """``out[r, c] = value(code(r, c)) * scale_values[scales[r // group_rows, c // group_cols]]``
    (float32 product; exact).

    Args:
        packed: uint8 codes, two a byte: ``[rows, K/2]`` (element ``2j`` of a row in the low
            nibble of byte ``j``), or with ``transposed`` its transpose ``[K/2, rows]``
            stored contiguously (an ``axis=0`` tensor's bytes, read as its K-last transpose).
        scales: the stored scale codes (uint8) ``[rows / group_rows, K / group_cols]``, or
            with ``scales_transposed`` its transpose stored contiguously.
        group_rows, group_cols: one scale's rows and columns (``group_cols`` even).
        scale_values: float32 ``[256]``, the value of every scale code (E4M3 or E8M0).
        out: ``[rows, K]``: float32, or uint16 (bfloat16's bits).
    """
    rows, half = out.shape[0], out.shape[1] // 2
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
            if r == r0 or r % group_rows == 0:  # a new row of scales (a tile's 16 rows share one)
                for g in range(half // words):
                    scale = scale_values[scales[g, scale_row] if scales_transposed else scales[scale_row, g]]
                    for j in range(words):
                        byte_scales[g * words + j] = scale
            _fold_row(buffer[r - r0] if transposed else packed[r], out[r], byte_scales)


@numba.njit(cache=True, error_model="numpy")
def fold_fp4_values_at(packed, transposed, scales, scales_transposed, group_rows, group_cols, scale_values, out, rows, k, like):
    """:func:`fold_fp4_values` by address (:func:`.numba_elements.at`): the packed codes
    (``[rows, K/2]``, or ``[K/2, rows]`` with ``transposed``), the scale codes (likewise)
    and ``out`` ``[rows, K]`` of float32 (``like`` float32) or bfloat16 (``like`` uint16)."""
    codes = at(packed, (k // 2, rows) if transposed else (rows, k // 2), np.uint8(0))
    shape = (k // group_cols, rows // group_rows) if scales_transposed else (rows // group_rows, k // group_cols)
    stored = at(scales, shape, np.uint8(0))
    fold_fp4_values(codes, transposed, stored, scales_transposed, group_rows, group_cols, scale_values, at(out, (rows, k), like))


@numba.njit(cache=True, inline="always", error_model="numpy")
def write_values(values, bf16, codes, transposed, scales, scales_transposed, group_rows, group_cols, nvfp4):
    """Where ``values`` (an address) is not 0, write there the K-last GEMM operand of the
    codes just written, as the GEMM would fold them (:func:`fold_fp4_values`: ``codes``
    and ``scales`` as stored, each read as its transpose with ``*transposed``, one
    scale a ``group_rows x group_cols`` group of the operand); float32, or with ``bf16``
    bfloat16. In the quantization's launch: the host's
    cost of a launch of its own is what this saves (issue 38)."""
    if values:
        rows, half = (codes.shape[1], codes.shape[0]) if transposed else (codes.shape[0], codes.shape[1])
        table = E4M3_VALUES if nvfp4 else E8M0_VALUES
        if bf16:
            out = at(values, (rows, 2 * half), np.uint16(0))
            fold_fp4_values(codes, transposed, scales, scales_transposed, group_rows, group_cols, table, out)
        else:
            wide = at(values, (rows, 2 * half), np.float32(0))
            fold_fp4_values(codes, transposed, scales, scales_transposed, group_rows, group_cols, table, wide)


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def repack_transposed(src, out):
    """``out`` (``[K, N/2]``): the E2M1 codes of ``src`` (``[N, K/2]``, two a byte along K)
    transposed and packed two a byte along N, as ``tensor._transpose_packed_along_rows``
    packs them: byte ``i`` of row ``2j`` holds the low nibbles of rows ``2i`` and ``2i + 1``'s
    byte ``j``; of row ``2j + 1``, their high nibbles. A task takes 16 row pairs: their new
    bytes first, a row pair at a time (long loops, which vectorize), then the scatter into
    ``out``'s columns (2.5x faster than scattering byte by byte)."""
    pairs, half = src.shape[0] // 2, src.shape[1]
    for task in prange((pairs + 15) // 16):
        i0, i1 = task * 16, min(pairs, task * 16 + 16)
        lows, highs = np.empty((i1 - i0, half), dtype=np.uint8), np.empty((i1 - i0, half), dtype=np.uint8)
        for i in range(i1 - i0):
            even, odd, low, high = src[2 * (i0 + i)], src[2 * (i0 + i) + 1], lows[i], highs[i]
            for j in range(half):  # (uint8 operands; the stores keep the low byte)
                low[j] = (even[j] & np.uint8(15)) | ((odd[j] & np.uint8(15)) << np.uint8(4))
                high[j] = (even[j] >> np.uint8(4)) | (odd[j] & np.uint8(0xF0))
        for j in range(half):
            low_row, high_row = out[2 * j, i0:i1], out[2 * j + 1, i0:i1]
            for i in range(i1 - i0):
                low_row[i], high_row[i] = lows[i, j], highs[i, j]


@numba.njit(cache=True, error_model="numpy")
def transpose_tiles_at(packed, scales, rows, k, out_codes, values, bf16, tile, nvfp4):
    """The transpose of a 2-D tile-scaled 4-bit tensor by address (:func:`.numba_elements.at`):
    its codes ``[rows, k/2]`` repacked into ``out_codes`` ``[k, rows/2]``
    (:func:`repack_transposed`), and the transpose's K-last GEMM operand written at
    ``values`` from them and the stored scales ``[rows/tile, k/tile]`` read transposed
    (:func:`write_values`; float32, or bfloat16 with ``bf16``)."""
    codes = at(out_codes, (k, rows // 2), np.uint8(0))
    repack_transposed(at(packed, (rows, k // 2), np.uint8(0)), codes)
    stored = at(scales, (rows // tile, k // tile), np.uint8(0))
    write_values(values, bf16, codes, False, stored, True, tile, tile, nvfp4)
