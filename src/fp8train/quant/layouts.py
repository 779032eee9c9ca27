"""Scale and data layouts: compact (what quantize returns and what is all-gathered) and
GEMM-ready (what the hardware GEMM reads).

Blockwise, for a tensor of 2-D shape ``[A, B]``:

==============================  ==================  =========================
component                       compact             GEMM-ready
==============================  ==================  =========================
rowwise data                    ``[A, B]``          ``[A, B]``
columnwise data                 ``[A, B]``          ``[B, A]`` (transposed)
rowwise scales, 1x128           ``[A, B/128]``      ``[B/128, pad4(A)]``
columnwise scales, 1x128        ``[A/128, B]``      ``[A/128, pad4(B)]``
rowwise scales, 128x128         ``[A/128, B/128]``  ``[A/128, pad4(B/128)]``
columnwise scales, 128x128      ``[A/128, B/128]``  ``[B/128, pad4(A/128)]``
==============================  ==================  =========================

MXFP8: the ``[rows, K/32]`` E8M0 matrix is padded to ``[roundup(rows,128), roundup(K/32,4)]``,
cut into 128x4 tiles stored one after another (row-major over tiles), and inside each
tile the 128 rows of 4 bytes are stored in the order 0,32,64,96,1,33,65,97,...,31,63,95,127.
Columnwise scales ``[M/32, K]`` use 4x128 tiles the same way, i.e. the swizzle of their
transpose.
"""

from __future__ import annotations

import torch

from ..spec.checks import check_type
from ..spec.granularities import GemmFamily, Granularity, round_up, view_2d_shape
from .cast import check_tensor
from .tensor import QuantizedTensor, transpose

__all__ = [
    "blockwise_gemm_scales",
    "blockwise_to_gemm_layout",
    "blockwise_from_gemm_layout",
    "swizzle_mx_scales",
    "unswizzle_mx_scales",
]

_PAD_MULTIPLE = 4  # GEMM-ready scales pad their last dim to a multiple of 4
_MX_TILE_ROWS = 128  # the hardware's MX scale tile: 128 rows of 4 bytes


def _blockwise(granularity: Granularity | str) -> Granularity:
    granularity = Granularity.coerce(granularity)
    if granularity.family is not GemmFamily.BLOCKWISE:
        raise ValueError(f"blockwise layouts apply to 'block1x128' and 'block128x128', not {str(granularity)!r}")
    return granularity


def blockwise_gemm_scales(operand: QuantizedTensor, rows: int, k_blocks: int) -> torch.Tensor:
    """The scales of a K-last blockwise GEMM operand in the storage cuBLAS reads, zero-padded.

    ``operand`` is 2-D, ``[R, K]`` data scaled along K (a ``block128x128`` tile's scales
    follow its data whatever its ``axis``: ``transpose`` keeps them so). Only its scales
    are read: no data is copied.

    Args:
        operand: a ``block1x128`` (scales ``(R, K/128)``) or ``block128x128`` (scales
            ``(R/128, K/128)``) tensor.
        rows: the GEMM's rows for this operand, ``>= R`` (the data's rows, padded).
        k_blocks: the GEMM's K blocks, ``>= K/128`` (K padded with zero blocks).

    Returns:
        A contiguous float32 tensor: ``[k_blocks, rows]`` for 1x128 scales (the outer dim
        fastest: element ``(r, j)`` of the operand at ``j * rows + r``), or
        ``[rows/128, k_blocks]`` for 128x128 tiles (the K blocks fastest). Padding is zero.
    """
    scale_inv = operand.scale_inv.to(torch.float32)
    if operand.granularity.symmetric:
        shape, scales = (rows // operand.granularity.block, k_blocks), scale_inv
    else:
        shape, scales = (k_blocks, rows), scale_inv.t()
    if tuple(scales.shape) == shape:  # nothing to pad: one copy, not zeros and then a copy
        return scales.clone(memory_format=torch.contiguous_format)
    storage = scale_inv.new_zeros(shape)
    storage[: scales.shape[0], : scales.shape[1]] = scales
    return storage


def blockwise_to_gemm_layout(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a blockwise :class:`QuantizedTensor` to GEMM-ready data and scales.

    Rowwise (``axis=-1``) data stays ``[A, B]``; columnwise (``axis=0``) data is transposed
    to ``[B, A]``. Scales are transposed and/or zero-padded as in the module table (the
    storage of :func:`blockwise_gemm_scales` for the K-last operand, padded to 4).

    Args:
        qt: a ``block1x128`` or ``block128x128`` tensor; ranks > 2 use their 2-D view.

    Returns:
        ``(data, scale_inv)``, both contiguous.

    Raises:
        ValueError: if ``qt`` is not blockwise.
    """
    check_type("qt", qt, QuantizedTensor, "a QuantizedTensor (from fp8train.quant.quantize)")
    granularity = _blockwise(qt.granularity)
    operand = transpose(qt) if qt.axis == 0 else qt  # K-last: [B, A] for columnwise
    data = operand.data.reshape(view_2d_shape(operand.data.shape))
    rows, k_blocks = data.shape[0], data.shape[1] // granularity.block
    if granularity.symmetric:
        k_blocks = round_up(k_blocks, _PAD_MULTIPLE)
    else:
        rows = round_up(rows, _PAD_MULTIPLE)
    return data.contiguous(), blockwise_gemm_scales(operand, rows, k_blocks)


def blockwise_from_gemm_layout(
    data: torch.Tensor, scale_inv: torch.Tensor, *, granularity: Granularity | str, axis: int
) -> QuantizedTensor:
    """Inverse of :func:`blockwise_to_gemm_layout`: back to the compact layout.

    Args:
        data: GEMM-ready FP8 data, ``[A, B]`` (rowwise) or ``[B, A]`` (columnwise).
        scale_inv: GEMM-ready scales, padded.
        granularity: ``"block1x128"`` or ``"block128x128"``.
        axis: -1 (rowwise) or 0 (columnwise), as in the original tensor.

    Returns:
        A 2-D :class:`QuantizedTensor` ``[A, B]`` with compact scales.

    Raises:
        ValueError: on a non-blockwise granularity or scales whose shape does not match.
    """
    granularity = _blockwise(granularity)
    check_tensor("data", data)
    check_tensor("scale_inv", scale_inv)
    if isinstance(axis, bool) or axis not in (-1, 0):
        raise ValueError(f"axis={axis!r} must be -1 (rowwise) or 0 (columnwise), as in the original tensor")
    if data.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(
            f"GEMM-ready data and scales are 2-D, got shapes {tuple(data.shape)} and {tuple(scale_inv.shape)}"
        )
    columnwise = axis == 0
    if columnwise:
        data = data.t()
    a, b = data.shape
    block = granularity.block
    if not granularity.symmetric:
        expected = (a // block, round_up(b, _PAD_MULTIPLE)) if columnwise else (b // block, round_up(a, _PAD_MULTIPLE))
        rows, cols = (a // block, b) if columnwise else (b // block, a)
    else:
        expected = (b // block, round_up(a // block, _PAD_MULTIPLE)) if columnwise else (a // block, round_up(b // block, _PAD_MULTIPLE))
        rows, cols = (b // block, a // block) if columnwise else (a // block, b // block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"GEMM-ready scales of shape {tuple(scale_inv.shape)} do not match data of shape "
            f"{tuple(data.shape)} for {str(granularity)} axis={axis}; expected {expected}"
        )
    scale_inv = scale_inv[:rows, :cols]
    transpose_back = (not granularity.symmetric) != columnwise
    if transpose_back:
        scale_inv = scale_inv.t()
    return QuantizedTensor(
        data=data.contiguous(),
        scale_inv=scale_inv.contiguous(),
        granularity=granularity,
        axis=axis,
        power_2_scales=_all_powers_of_2(scale_inv),
    )


def _all_powers_of_2(scale_inv: torch.Tensor) -> bool:
    return bool(((scale_inv.to(torch.float32).view(torch.int32) & 0x007FFFFF) == 0).all())


def _swizzle_rowwise(scales: torch.Tensor) -> torch.Tensor:
    rows, cols = scales.shape
    padded_rows, padded_cols = round_up(rows, _MX_TILE_ROWS), round_up(cols, _PAD_MULTIPLE)
    bytes_ = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    padded = bytes_.new_zeros(padded_rows, padded_cols)
    padded[:rows, :cols] = bytes_
    # (row tile, 128 rows, col tile, 4) -> tiles in row-major order
    tiles = padded.view(padded_rows // _MX_TILE_ROWS, _MX_TILE_ROWS, padded_cols // 4, 4).permute(0, 2, 1, 3)
    # inside a tile, row r = 32 * a + b is stored at position 4 * b + a
    tiles = tiles.reshape(-1, 4, 32, 4).transpose(1, 2)
    out = tiles.reshape(padded_rows, padded_cols)
    return out.view(scales.dtype) if scales.dtype != torch.uint8 else out


def _unswizzle_rowwise(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    padded_rows, padded_cols = round_up(rows, _MX_TILE_ROWS), round_up(cols, _PAD_MULTIPLE)
    if swizzled.numel() != padded_rows * padded_cols:
        raise ValueError(
            f"swizzled scales hold {swizzled.numel()} values; a [{rows}, {cols}] scale matrix "
            f"swizzles to {padded_rows} x {padded_cols} = {padded_rows * padded_cols}"
        )
    bytes_ = swizzled.view(torch.uint8) if swizzled.dtype != torch.uint8 else swizzled
    tiles = bytes_.reshape(-1, 32, 4, 4).transpose(1, 2)
    tiles = tiles.reshape(padded_rows // _MX_TILE_ROWS, padded_cols // 4, _MX_TILE_ROWS, 4).permute(0, 2, 1, 3)
    out = tiles.reshape(padded_rows, padded_cols)[:rows, :cols].contiguous()
    return out.view(swizzled.dtype) if swizzled.dtype != torch.uint8 else out


def _check_scale_dtype(scales: torch.Tensor) -> None:
    check_tensor("scale_inv", scales)
    if scales.element_size() != 1:
        raise ValueError(f"MX scales are 1-byte values (float8_e8m0fnu or uint8), got {scales.dtype}")


def swizzle_mx_scales(scale_inv: torch.Tensor, *, axis: int = -1) -> torch.Tensor:
    """Swizzle compact MXFP8 scales into the GEMM-ready 128x4-tile layout.

    Args:
        scale_inv: compact E8M0 (or uint8) scales: ``[rows, K/32]`` for ``axis=-1``, or
            ``[M/32, K]`` for ``axis=0`` (4x128 tiles: the swizzle of its transpose).
        axis: the axis the scales were quantized along.

    Returns:
        A contiguous tensor of the same dtype and shape ``[roundup(R, 128), roundup(C, 4)]``
        (``R, C`` the rowwise-oriented dims) whose flattened bytes are in hardware order;
        padding is zero.
    """
    _check_scale_dtype(scale_inv)
    if scale_inv.dim() != 2:
        raise ValueError(f"MX scales must be 2-D, got shape {tuple(scale_inv.shape)}")
    if axis == 0:
        scale_inv = scale_inv.t()
    elif axis != -1:
        raise ValueError(f"axis={axis!r} must be -1 (rowwise scales) or 0 (columnwise scales)")
    return _swizzle_rowwise(scale_inv.contiguous())


def unswizzle_mx_scales(swizzled: torch.Tensor, shape: tuple[int, int], *, axis: int = -1) -> torch.Tensor:
    """Inverse of :func:`swizzle_mx_scales`.

    Args:
        swizzled: the GEMM-ready scales (any shape with the right number of values).
        shape: the compact shape to restore (``[rows, K/32]`` or ``[M/32, K]``).
        axis: as given to :func:`swizzle_mx_scales`.

    Returns:
        The compact scales of ``shape``, contiguous.
    """
    _check_scale_dtype(swizzled)
    rows, cols = shape
    if axis == 0:
        return _unswizzle_rowwise(swizzled, cols, rows).t().contiguous()
    if axis != -1:
        raise ValueError(f"axis={axis!r} must be -1 (rowwise scales) or 0 (columnwise scales)")
    return _unswizzle_rowwise(swizzled, rows, cols)
