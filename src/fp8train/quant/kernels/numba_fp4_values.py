"""The numba kernel behind :func:`.operands.try_fp4_operand_values`: a K-last
4-bit operand's packed E2M1 codes to its values with the block scales folded in, in one
pass (imported only when numba is). The PyTorch ops of
:func:`fp8train.quant.gemm.fp4.fp4_operand_values` are the reference: the same float32
products (exact), so the same bits.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .numba_elements import at

ROWS_PER_TASK = 64
"""Output rows one parallel task fills."""


@numba.njit(parallel=True, cache=True, boundscheck=False, error_model="numpy")
def fold_fp4_values(packed, transposed, scales, block, lut, out, bfloat16):
    """``out[r, c] = lut[code(r, c)] * scales[r, c // block]`` (float32 product; exact).

    Args:
        packed: uint8 codes, two a byte: ``[rows, K/2]`` (element ``2j`` of a row in the low
            nibble of byte ``j``), or with ``transposed`` its transpose ``[K/2, rows]``
            stored contiguously (an ``axis=0`` tensor's bytes, read as its K-last transpose).
        transposed: whether ``packed`` is stored ``[K/2, rows]``.
        scales: float32 ``[rows, K/block]``, one per (row, K block).
        block: the K block (16 or 32).
        lut: float32 ``[16]``, the value of every E2M1 code.
        out: ``[rows, K]``, float32, or uint16 (``bfloat16``: the product's upper half,
            exact since it has at most 6 significant bits).
        bfloat16: whether ``out`` takes bfloat16 bits.
    """
    rows, k = out.shape
    half = k // 2
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            for j in range(half):
                byte = packed[j, r] if transposed else packed[r, j]
                scale = scales[r, (2 * j) // block]
                low = np.float32(lut[byte & 15] * scale)
                high = np.float32(lut[byte >> 4] * scale)
                if bfloat16:
                    out[r, 2 * j] = np.uint16(low.view(np.uint32) >> 16)
                    out[r, 2 * j + 1] = np.uint16(high.view(np.uint32) >> 16)
                else:
                    out[r, 2 * j] = low
                    out[r, 2 * j + 1] = high


@numba.njit(cache=True, error_model="numpy")
def fold_fp4_values_at(packed, transposed, scales, block, lut, out, rows, k, like, bfloat16):
    """:func:`fold_fp4_values` by address (:func:`.numba_elements.at`): the packed codes
    (``[rows, K/2]``, or ``[K/2, rows]`` with ``transposed``), the float32 scales
    ``[rows, K/block]`` and ``out`` ``[rows, K]`` of ``like``'s dtype (uint16: ``bfloat16``)."""
    codes = at(packed, (k // 2, rows) if transposed else (rows, k // 2), np.uint8(0))
    stored = at(scales, (rows, k // block), np.float32(0))
    fold_fp4_values(codes, transposed, stored, block, lut, at(out, (rows, k), like), bfloat16)
