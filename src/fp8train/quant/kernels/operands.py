"""The emulated GEMM's operands from their codes on CPU, in one pass, compiled by numba:
an FP8 operand's values times its power-of-two scales (:mod:`.numba_fp8_values`), a K-last
4-bit operand's values times its block scales (:mod:`.numba_fp4_values`). The PyTorch ops
of :mod:`fp8train.quant.gemm.emulated` and :mod:`fp8train.quant.gemm.fp4` are the
reference; these give the same bits. The ``try_*`` entry points return ``None`` where the
kernels do not apply (:func:`.launch.kernels_usable`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..tensor import QuantizedTensor
from .launch import KERNEL_LAUNCH, kernels_usable

__all__ = ["try_operand_values", "operand_values", "scaled_fp8_values", "try_fp4_operand_values"]

_UNIT_SCALE = torch.ones((1, 1), dtype=torch.float32)
"""The one scale of bare values as the kernel reads it: a ``[1, 1]`` float32 tensor, built
once (not a tensor, a reshape and a view per GEMM operand)."""

_OUT_LIKE = {torch.float32: np.float32(0), torch.bfloat16: np.uint16(0)}
"""How the kernels write an operand of each dtype (bfloat16 as its bits)."""


def try_operand_values(qt: QuantizedTensor, power_2: bool, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The emulated GEMM's operand of the 2-D ``qt`` as ``out_dtype``: its FP8 values times
    its scales where they are powers of two (``power_2``), else the bare values (as
    :func:`scaled_fp8_values`); ``None`` where the kernels do not apply (4-bit data too)."""
    if qt.granularity.fp4 or not kernels_usable(qt.data):
        return None
    return operand_values(qt, power_2, out_dtype)


def operand_values(qt: QuantizedTensor, power_2: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`try_operand_values` for an FP8 operand the caller has checked the kernels take."""
    if not power_2:
        return _values(qt.data, None, (0, 0), out_dtype)
    rows, k = qt.data.shape
    scale_inv = qt.scale_inv  # float32, or E8M0 codes the kernel decodes (no host op, issue 38)
    if scale_inv.ndim == 2 and rows and k:  # one per group already: the groups' shape from the two (no call, issue 38)
        scale_rows, scale_cols = scale_inv.shape
        return _values(qt.data, scale_inv, (rows // scale_rows, k // scale_cols), out_dtype)
    group_rows, group_cols = qt.granularity.group_shape(qt.axis, (rows, k))  # qt.group_shape, for FP8's 2-D data
    scale_inv = scale_inv.reshape(rows // group_rows, k // group_cols)
    return _values(qt.data, scale_inv, (group_rows, group_cols), out_dtype)


def scaled_fp8_values(
    data: torch.Tensor, scale_inv: torch.Tensor, group: tuple[int, int], out_dtype: torch.dtype
) -> torch.Tensor:
    """``value(data) * scale_inv`` per ``group`` (rows, cols) as ``out_dtype`` (bfloat16 or
    float32), in one pass: the emulated GEMM's operand, for power-of-two ``scale_inv``
    (float32, one per group, in ``data``'s orientation). A transposed ``data`` (a first-dim
    operand) is converted in memory order and comes back transposed.

    Equal, bit for bit, to ``fp8_to_hp(data, out_dtype) * scale_inv.to(out_dtype)`` per
    group (a NaN's sign aside).
    """
    return _values(data, scale_inv.to(torch.float32), group, out_dtype)


def _values(data: torch.Tensor, scale_inv: torch.Tensor | None, group: tuple[int, int], out_dtype: torch.dtype):
    """:func:`scaled_fp8_values` for float32 ``scale_inv``, or for bare values (``None``:
    one unit scale, ``group`` ignored), in as few host calls as the launch allows."""
    # Contiguous, or a contiguous tensor's transpose (a first-dim operand), from one read of
    # the strides (is_contiguous's test for 2-D data, its size-1 dims free; issue 38).
    (rows, cols), (row_stride, col_stride) = data.shape, data.stride()
    transposed = False
    if not ((col_stride == 1 or cols == 1) and (row_stride == cols or rows == 1)):
        transposed = (row_stride == 1 or rows == 1) and (col_stride == rows or cols == 1)
        if transposed:
            data, group = data.t(), group[::-1]
            scale_inv = None if scale_inv is None else scale_inv.t()
        else:
            data = data.contiguous()
    (m, n) = shape = data.shape
    if scale_inv is None:
        scale_inv, group = _UNIT_SCALE, shape
    else:
        scale_inv = scale_inv.contiguous()
    out = torch.empty(shape, dtype=out_dtype)
    scale_rows, scale_cols = scale_inv.shape
    args = (data.data_ptr(), m, n, out.data_ptr(), _OUT_LIKE[out_dtype], scale_inv.data_ptr(), scale_rows, scale_cols)
    kernel, e4m3 = _compiled_fp8_values().scaled_fp8_values_at, data.dtype == torch.float8_e4m3fn
    e8m0 = scale_inv.dtype == torch.float8_e8m0fnu
    if KERNEL_LAUNCH.depth:  # this thread holds the kernels (a layer's block): no block of its own
        kernel(*args, group[0], group[1], e4m3, e8m0)
    else:
        with KERNEL_LAUNCH:
            kernel(*args, group[0], group[1], e4m3, e8m0)
    return out.t() if transposed else out


@functools.cache
def _compiled_fp8_values():
    from . import numba_fp8_values

    return numba_fp8_values


def try_fp4_operand_values(qt, dtype: torch.dtype, checked: bool | None = None) -> torch.Tensor | None:
    """The K-last 4-bit operand ``qt``'s values times their block scales, ``[rows, K]`` of
    ``dtype`` (float32 or bfloat16), from one pass of :func:`.numba_fp4_values.fold_fp4_values`
    over its codes and its stored scales (decoded there); ``None`` where the kernels do not
    apply (:func:`.launch.kernels_usable`, unless ``checked``: the caller knows they do),
    or do not take this operand (not 2-D, empty, neither it nor its transpose contiguous)."""
    data, scales, granularity = qt.data, qt.scale_inv, qt.granularity
    if not (checked or kernels_usable(data)):
        return None
    like = _ELEMENT_LIKE[dtype] if dtype in _ELEMENT_LIKE and qt.axis == -1 else None
    try:
        (rows, half), (scale_rows, scale_cols) = data.shape, scales.shape
    except ValueError:
        return None
    group_rows, group_cols = granularity.across, granularity.along  # a K-last operand's group
    if like is None or rows == 0 or half == 0 or (scale_rows, scale_cols) != (rows // group_rows, 2 * half // group_cols):
        return None
    # Each contiguous, or a contiguous tensor's transpose (a dim of size 1 has any stride).
    (row_stride, col_stride), (scale_row_stride, scale_col_stride) = data.stride(), scales.stride()
    transposed = not ((rows == 1 or row_stride == half) and (half == 1 or col_stride == 1))
    if transposed and not ((half == 1 or col_stride == rows) and (rows == 1 or row_stride == 1)):
        return None
    scales_transposed = not (
        (scale_rows == 1 or scale_row_stride == scale_cols) and (scale_cols == 1 or scale_col_stride == 1)
    )
    if scales_transposed and not (
        (scale_cols == 1 or scale_col_stride == scale_rows) and (scale_rows == 1 or scale_row_stride == 1)
    ):
        scales, scales_transposed = scales.contiguous(), False
    out = torch.empty(rows, 2 * half, dtype=dtype)
    kernel, e4m3_values, e8m0_values = _fold_kernel()
    args = (data.data_ptr(), transposed, scales.data_ptr(), scales_transposed, group_rows, group_cols)
    args = (*args, e8m0_values if granularity.e8m0_scales else e4m3_values, out.data_ptr(), rows, 2 * half, like)
    if KERNEL_LAUNCH.depth:  # this thread holds the kernels (a layer's block): no block of its own
        kernel(*args)
    else:
        with KERNEL_LAUNCH:
            kernel(*args)
    return out


_ELEMENT_LIKE = {torch.float32: np.float32(0), torch.bfloat16: np.uint16(0)}
"""The element :func:`try_fp4_operand_values`' kernel writes a value of each dtype as."""


@functools.cache
def _fold_kernel():
    """The 4-bit operand kernel, and the float32 value of every E4M3 and E8M0 scale code
    (NumPy arrays): the tables the quantizers' own values pass folds with
    (:data:`.numba_fp4_values.E4M3_VALUES`, :data:`.numba_fp4_values.E8M0_VALUES`), decoded
    as :meth:`~fp8train.quant.tensor.QuantizedTensor.scale_inv_float32` decodes them."""
    from . import numba_fp4_values

    return numba_fp4_values.fold_fp4_values_at, numba_fp4_values.E4M3_VALUES, numba_fp4_values.E8M0_VALUES
