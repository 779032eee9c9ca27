"""Scale layouts in JAX: compact (what :func:`~fp8train.jax.quantize.quantize` returns) and
GEMM-ready (what a hardware GEMM reads), as :mod:`fp8train.quant.layouts` defines them.

Blockwise, for a 2-D ``[A, B]``: rowwise data ``[A, B]``, columnwise data transposed to
``[B, A]``; 1x128 scales rowwise ``[A, B/128] -> [B/128, pad4(A)]``, columnwise
``[A/128, B] -> [A/128, pad4(B)]``; 128x128 scales rowwise ``[A/128, pad4(B/128)]``,
columnwise ``[B/128, pad4(A/128)]``; zero padding.

MXFP8: the ``[rows, K/32]`` E8M0 matrix is padded to ``[roundup(rows,128), roundup(K/32,4)]``,
cut into 128x4 tiles stored one after another, and inside each tile the 128 rows are stored
in the order 0,32,64,96,1,33,...,127. Columnwise scales ``[M/32, K]`` are the swizzle of
their transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..spec.checks import check_type
from ..spec.granularities import GemmFamily, round_up, view_2d_shape
from .cast import check_array
from .quantize import QuantizedArray

__all__ = ["blockwise_to_gemm_layout", "swizzle_mx_scales", "unswizzle_mx_scales"]

_PAD_MULTIPLE = 4
_MX_TILE_ROWS = 128


def _pad_last_dim(t: jax.Array, multiple: int) -> jax.Array:
    return jnp.pad(t, ((0, 0), (0, round_up(t.shape[1], multiple) - t.shape[1])))


def blockwise_to_gemm_layout(qa: QuantizedArray) -> tuple[jax.Array, jax.Array]:
    """GEMM-ready ``(data, scale_inv)`` of a ``block1x128`` or ``block128x128``
    :class:`QuantizedArray` (ranks > 2 use their 2-D view), as
    :func:`fp8train.quant.blockwise_to_gemm_layout`.

    Raises:
        ValueError: ``qa`` is not blockwise.
    """
    check_type("qa", qa, QuantizedArray, "a QuantizedArray (from fp8train.jax.quantize)")
    if qa.granularity.family is not GemmFamily.BLOCKWISE:
        raise ValueError(f"blockwise layouts apply to 'block1x128' and 'block128x128', not {str(qa.granularity)!r}")
    columnwise = qa.axis == 0
    data = qa.data.reshape(view_2d_shape(tuple(qa.data.shape)))
    scale_inv = qa.scale_inv
    if not qa.granularity.symmetric:
        scale_inv = scale_inv if columnwise else scale_inv.T
    elif columnwise:
        scale_inv = scale_inv.T
    if columnwise:
        data = data.T
    return data, _pad_last_dim(scale_inv, _PAD_MULTIPLE)


def _as_bytes(scales: jax.Array) -> jax.Array:
    return scales if scales.dtype == jnp.uint8 else lax.bitcast_convert_type(scales, jnp.uint8)


def _from_bytes(values: jax.Array, dtype) -> jax.Array:
    return values if dtype == jnp.uint8 else lax.bitcast_convert_type(values, dtype)


def _check_scales(scales) -> jax.Array:
    scales = check_array("scale_inv", scales)
    if scales.dtype.itemsize != 1:
        raise ValueError(f"MX scales are 1-byte values (float8_e8m0fnu or uint8), got {scales.dtype}")
    return scales


def swizzle_mx_scales(scale_inv: jax.Array, *, axis: int = -1) -> jax.Array:
    """Compact MXFP8 scales to the GEMM-ready 128x4-tile layout, as
    :func:`fp8train.quant.swizzle_mx_scales`: shape ``[roundup(R, 128), roundup(C, 4)]`` (``R, C``
    the rowwise-oriented dims), same dtype, flattened bytes in hardware order. The 4-bit
    GEMM takes its block scales (E4M3 or E8M0, one per row and K block: repeat ``nvfp4_2d``'s
    over their 16 rows first) in the same layout.

    Raises:
        ValueError: scales not 2-D or not 1-byte, or ``axis`` not -1 or 0.
    """
    scale_inv = _check_scales(scale_inv)
    if scale_inv.ndim != 2:
        raise ValueError(f"MX scales must be 2-D, got shape {tuple(scale_inv.shape)}")
    if axis == 0:
        scale_inv = scale_inv.T
    elif axis != -1:
        raise ValueError(f"axis={axis!r} must be -1 (rowwise scales) or 0 (columnwise scales)")
    rows, cols = scale_inv.shape
    padded_rows, padded_cols = round_up(rows, _MX_TILE_ROWS), round_up(cols, _PAD_MULTIPLE)
    padded = jnp.zeros((padded_rows, padded_cols), jnp.uint8).at[:rows, :cols].set(_as_bytes(scale_inv))
    tiles = padded.reshape(padded_rows // _MX_TILE_ROWS, _MX_TILE_ROWS, padded_cols // 4, 4).transpose(0, 2, 1, 3)
    # inside a tile, row r = 32 * a + b is stored at position 4 * b + a
    tiles = tiles.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3)
    return _from_bytes(tiles.reshape(padded_rows, padded_cols), scale_inv.dtype)


def unswizzle_mx_scales(swizzled: jax.Array, shape: tuple[int, int], *, axis: int = -1) -> jax.Array:
    """Inverse of :func:`swizzle_mx_scales`: the compact scales of ``shape``.

    Raises:
        ValueError: the number of values does not match ``shape``, or a bad ``axis``.
    """
    swizzled = _check_scales(swizzled)
    if axis not in (-1, 0):
        raise ValueError(f"axis={axis!r} must be -1 (rowwise scales) or 0 (columnwise scales)")
    rows, cols = shape if axis == -1 else shape[::-1]
    padded_rows, padded_cols = round_up(rows, _MX_TILE_ROWS), round_up(cols, _PAD_MULTIPLE)
    if swizzled.size != padded_rows * padded_cols:
        raise ValueError(
            f"swizzled scales hold {swizzled.size} values; a [{rows}, {cols}] scale matrix "
            f"swizzles to {padded_rows} x {padded_cols} = {padded_rows * padded_cols}"
        )
    tiles = _as_bytes(swizzled).reshape(-1, 32, 4, 4).transpose(0, 2, 1, 3)
    tiles = tiles.reshape(padded_rows // _MX_TILE_ROWS, padded_cols // 4, _MX_TILE_ROWS, 4).transpose(0, 2, 1, 3)
    out = _from_bytes(tiles.reshape(padded_rows, padded_cols)[:rows, :cols], swizzled.dtype)
    return out.T if axis == 0 else out
