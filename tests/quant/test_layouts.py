"""Compact <-> GEMM-ready layouts: blockwise transposes/padding and the MXFP8 scale swizzle
(NUMERICS.md section 3, the tables in layouts.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from fp8train.quant.layouts import (
    blockwise_from_gemm_layout,
    blockwise_to_gemm_layout,
    swizzle_mx_scales,
    unswizzle_mx_scales,
)
from fp8train.quant import quantize
from fp8train.quant.tensor import QuantizedTensor

BLOCKWISE_CASES = [(g, a) for g in ("block1x128", "block128x128") for a in (-1, 0)]
# Multiples of 128 that are not multiples of 512, so pad4 of the tile count matters.
BLOCKWISE_SHAPES = [(384, 128), (128, 640), (640, 384), (256, 512)]
MX_SCALE_SHAPES = [(1, 1), (33, 5), (200, 7), (129, 4), (256, 8), (128, 4), (5, 130)]
MX_TILE_ROWS, MX_TILE_COLS = 128, 4
# Inside a 128x4 tile, rows are stored in this order (4 bytes each).
MX_IN_TILE_ROW_ORDER = [row for b in range(32) for row in (b, b + 32, b + 64, b + 96)]


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _quantized(shape, granularity, axis, seed=0) -> QuantizedTensor:
    generator = torch.Generator().manual_seed(seed)
    # Magnitudes spread over many binades so the blocks get different scales.
    x = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-20, 20, shape, generator=generator))
    return quantize(x, granularity, axis=axis)


def _gemm_shapes(granularity: str, axis: int, a: int, b: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """GEMM-ready (data, scale_inv) shapes for a tensor [A, B]: the table in NUMERICS.md."""
    data = (a, b) if axis == -1 else (b, a)
    if granularity == "block1x128":
        scales = (b // 128, _pad4(a)) if axis == -1 else (a // 128, _pad4(b))
    else:
        scales = (a // 128, _pad4(b // 128)) if axis == -1 else (b // 128, _pad4(a // 128))
    return data, scales


# ---------------------------------------------------------------- blockwise


@pytest.mark.parametrize("granularity, axis", BLOCKWISE_CASES)
@pytest.mark.parametrize("shape", BLOCKWISE_SHAPES)
def test_blockwise_gemm_layout_shapes_and_round_trip(granularity, axis, shape):
    qt = _quantized(shape, granularity, axis)
    data, scale_inv = blockwise_to_gemm_layout(qt)
    expected_data_shape, expected_scale_shape = _gemm_shapes(granularity, axis, *shape)
    assert data.shape == expected_data_shape and data.dtype == qt.data.dtype
    assert scale_inv.shape == expected_scale_shape and scale_inv.dtype == torch.float32
    assert data.is_contiguous() and scale_inv.is_contiguous()

    back = blockwise_from_gemm_layout(data, scale_inv, granularity=granularity, axis=axis)
    assert (back.granularity, back.axis) == (granularity, axis)
    assert torch.equal(back.data.view(torch.uint8), qt.data.view(torch.uint8))
    assert torch.equal(back.scale_inv.view(torch.int32), qt.scale_inv.view(torch.int32))
    assert torch.equal(back.dequantize(), qt.dequantize())


@pytest.mark.parametrize("granularity, axis", BLOCKWISE_CASES)
@pytest.mark.parametrize("shape", BLOCKWISE_SHAPES)
def test_blockwise_gemm_layout_contents(granularity, axis, shape):
    qt = _quantized(shape, granularity, axis, seed=1)
    data, scale_inv = blockwise_to_gemm_layout(qt)
    expected_data = qt.data if axis == -1 else qt.data.t()
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
    # Which compact scales are transposed: 1x128 rowwise, and 128x128 columnwise.
    transposed = (granularity == "block1x128") == (axis == -1)
    compact = qt.scale_inv.t() if transposed else qt.scale_inv
    rows, cols = compact.shape
    assert torch.equal(scale_inv[:, :cols], compact)
    assert not scale_inv[:, cols:].any(), "padding must be zero"
    assert rows == scale_inv.shape[0]


def test_blockwise_128x128_padding_by_hand():
    # [128, 640]: one row of five 128x128 tiles with scale_inv 1, 2, 4, 8, 16 (by construction).
    data = torch.zeros(128, 640).to(torch.float8_e4m3fn)
    scales = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0]])
    rowwise = QuantizedTensor(data=data, scale_inv=scales, granularity="block128x128", axis=-1)
    _, gemm_scales = blockwise_to_gemm_layout(rowwise)
    assert gemm_scales.tolist() == [[1.0, 2.0, 4.0, 8.0, 16.0, 0.0, 0.0, 0.0]]

    columnwise = QuantizedTensor(data=data, scale_inv=scales, granularity="block128x128", axis=0)
    gemm_data, gemm_scales = blockwise_to_gemm_layout(columnwise)
    assert gemm_data.shape == (640, 128)
    assert gemm_scales.tolist() == [[v, 0.0, 0.0, 0.0] for v in (1.0, 2.0, 4.0, 8.0, 16.0)]


def test_blockwise_1x128_layout_by_hand():
    # [256, 384] with 1x128 groups: compact rowwise scales [256, 3], scale_inv[i, j] = i + 1000 j.
    data = torch.arange(256 * 384).remainder(200).float().reshape(256, 384).to(torch.float8_e4m3fn)
    rows = torch.arange(256, dtype=torch.float32)
    compact = rows[:, None] + 1000 * torch.arange(3, dtype=torch.float32)
    rowwise = QuantizedTensor(data=data, scale_inv=compact, granularity="block1x128", axis=-1)
    gemm_data, gemm_scales = blockwise_to_gemm_layout(rowwise)
    assert torch.equal(gemm_data.view(torch.uint8), data.view(torch.uint8))  # rowwise data stays [A, B]
    assert gemm_scales.shape == (3, 256)
    assert gemm_scales[2, 7].item() == 2007.0  # block (row 7, column block 2) lands at [2, 7]

    # columnwise: compact [256/128, 384] stays [2, 384] (no transpose, no padding needed);
    # the data is transposed to [384, 256]
    compact = torch.arange(2 * 384, dtype=torch.float32).reshape(2, 384)
    columnwise = QuantizedTensor(data=data, scale_inv=compact, granularity="block1x128", axis=0)
    gemm_data, gemm_scales = blockwise_to_gemm_layout(columnwise)
    assert gemm_data.shape == (384, 256)
    assert gemm_data[5, 9].view(torch.uint8).item() == data[9, 5].view(torch.uint8).item()
    assert torch.equal(gemm_scales, compact)


def test_blockwise_rank_3_uses_2d_view():
    qt = _quantized((3, 128, 256), "block1x128", -1)
    data, scale_inv = blockwise_to_gemm_layout(qt)
    assert data.shape == (384, 256)
    assert scale_inv.shape == (2, 384)
    assert torch.equal(scale_inv, qt.scale_inv.t())


@pytest.mark.parametrize("granularity", ["tensor", "row", "mx"])
def test_blockwise_layout_rejects_other_granularities(granularity):
    qt = _quantized((128, 128), granularity, -1)
    message = rf"blockwise layouts apply to 'block1x128' and 'block128x128', not '{granularity}'"
    with pytest.raises(ValueError, match=message):
        blockwise_to_gemm_layout(qt)
    with pytest.raises(ValueError, match=r"blockwise layouts apply to"):
        blockwise_from_gemm_layout(qt.data, torch.ones(1, 4), granularity=granularity, axis=-1)


@pytest.mark.parametrize("granularity, axis", BLOCKWISE_CASES)
def test_blockwise_from_gemm_layout_rejects_wrong_scale_shape(granularity, axis):
    qt = _quantized((128, 640), granularity, axis)
    data, scale_inv = blockwise_to_gemm_layout(qt)
    for bad in (scale_inv[:, :-1], scale_inv.t(), torch.cat([scale_inv, scale_inv])):
        with pytest.raises(ValueError, match=re.escape(f"GEMM-ready scales of shape {tuple(bad.shape)} do not match")):
            blockwise_from_gemm_layout(data, bad, granularity=granularity, axis=axis)


# ---------------------------------------------------------------- MXFP8 swizzle


def _reference_swizzle(compact: np.ndarray) -> np.ndarray:
    """Scalar reference: the flat byte offset of every compact (row, col), per NUMERICS.md."""
    rows, cols = compact.shape
    padded_rows, padded_cols = _round_up(rows, MX_TILE_ROWS), _round_up(cols, MX_TILE_COLS)
    tiles_per_row = padded_cols // MX_TILE_COLS
    out = np.zeros(padded_rows * padded_cols, dtype=np.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // MX_TILE_ROWS) * tiles_per_row + c // MX_TILE_COLS
            row_in_tile = r % MX_TILE_ROWS
            slot = MX_IN_TILE_ROW_ORDER.index(row_in_tile)
            offset = tile * MX_TILE_ROWS * MX_TILE_COLS + slot * MX_TILE_COLS + c % MX_TILE_COLS
            out[offset] = compact[r, c]
    return out


def _random_codes(shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # 1..254 so that zero padding cannot be confused with data
    return torch.randint(1, 255, shape, generator=generator, dtype=torch.uint8)


@pytest.mark.parametrize("shape", MX_SCALE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e8m0fnu], ids=str)
@pytest.mark.parametrize("axis", [-1, 0])
def test_swizzle_round_trip_and_reference(shape, dtype, axis):
    codes = _random_codes(shape, seed=shape[0] * 1000 + shape[1])
    scales = codes.view(dtype)
    swizzled = swizzle_mx_scales(scales, axis=axis)
    rowwise_oriented = codes if axis == -1 else codes.t()
    rows, cols = rowwise_oriented.shape
    assert swizzled.shape == (_round_up(rows, MX_TILE_ROWS), _round_up(cols, MX_TILE_COLS))
    assert swizzled.dtype == dtype and swizzled.is_contiguous()
    expected = _reference_swizzle(rowwise_oriented.numpy())
    np.testing.assert_array_equal(swizzled.view(torch.uint8).reshape(-1).numpy(), expected)

    back = unswizzle_mx_scales(swizzled, shape, axis=axis)
    assert back.shape == shape and back.dtype == dtype and back.is_contiguous()
    assert torch.equal(back.view(torch.uint8), codes)
    # Any shape with the right number of values is accepted, e.g. flat.
    assert torch.equal(unswizzle_mx_scales(swizzled.reshape(-1), shape, axis=axis).view(torch.uint8), codes)


def test_swizzle_in_tile_row_order_by_hand():
    rows = torch.arange(128, dtype=torch.uint8)[:, None].expand(128, 4).contiguous()
    swizzled = swizzle_mx_scales(rows).reshape(-1).tolist()
    expected = []
    for b in range(32):
        for row in (b, b + 32, b + 64, b + 96):
            expected += [row] * 4
    assert swizzled[:24] == [0, 0, 0, 0, 32, 32, 32, 32, 64, 64, 64, 64, 96, 96, 96, 96, 1, 1, 1, 1, 33, 33, 33, 33]
    assert swizzled == expected
    # columns keep their order inside each 4-byte row
    cols = torch.arange(4, dtype=torch.uint8)[None, :].expand(128, 4).contiguous()
    assert swizzle_mx_scales(cols).reshape(-1).tolist() == [0, 1, 2, 3] * 128


def test_swizzle_tiles_are_row_major():
    # [256, 8] = 2 x 2 tiles; value = 1 + tile index in row-major order
    r = torch.arange(256)[:, None]
    c = torch.arange(8)[None, :]
    scales = (1 + (r // 128) * 2 + c // 4).to(torch.uint8)
    flat = swizzle_mx_scales(scales).reshape(-1)
    for tile in range(4):
        assert (flat[tile * 512 : (tile + 1) * 512] == tile + 1).all(), tile


def test_swizzle_pads_with_zeros():
    scales = torch.full((33, 5), 7, dtype=torch.uint8)
    swizzled = swizzle_mx_scales(scales)
    assert swizzled.shape == (128, 8)
    assert int((swizzled == 7).sum()) == 33 * 5
    assert int((swizzled == 0).sum()) == 128 * 8 - 33 * 5
    # the second 128x4 tile holds column 4 only: row r, column 4 -> tile 1, slot of r, byte 0
    flat = swizzled.reshape(-1)
    assert flat[512].item() == 7 and flat[513:516].tolist() == [0, 0, 0]


def test_swizzle_columnwise_is_swizzle_of_transpose():
    scales = _random_codes((3, 200), seed=9)  # [M/32, K] with M = 96, K = 200
    assert torch.equal(swizzle_mx_scales(scales, axis=0), swizzle_mx_scales(scales.t().contiguous(), axis=-1))
    assert swizzle_mx_scales(scales, axis=0).shape == (256, 4)


def test_swizzle_of_quantized_mx_scales_round_trips():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(160, 96, generator=generator) * torch.exp2(torch.randint(-30, 30, (160, 96), generator=generator))
    for axis in (-1, 0):
        scale_inv = quantize(x, "mx", axis=axis).scale_inv
        swizzled = swizzle_mx_scales(scale_inv, axis=axis)
        back = unswizzle_mx_scales(swizzled, tuple(scale_inv.shape), axis=axis)
        assert torch.equal(back.view(torch.uint8), scale_inv.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_swizzle_rejects_wide_dtypes(dtype):
    with pytest.raises(ValueError, match=rf"MX scales are 1-byte values \(float8_e8m0fnu or uint8\), got {dtype}"):
        swizzle_mx_scales(torch.ones(4, 4, dtype=dtype))
    with pytest.raises(ValueError, match=r"MX scales are 1-byte values"):
        unswizzle_mx_scales(torch.ones(128, 4, dtype=dtype), (4, 4))


@pytest.mark.parametrize("shape", [(4,), (2, 4, 4), ()])
def test_swizzle_rejects_non_2d(shape):
    with pytest.raises(ValueError, match=r"MX scales must be 2-D, got shape"):
        swizzle_mx_scales(torch.ones(shape, dtype=torch.uint8))


@pytest.mark.parametrize("axis", [1, -2, 2])
def test_swizzle_rejects_bad_axis(axis):
    with pytest.raises(ValueError, match=rf"axis={axis} must be -1 \(rowwise scales\) or 0"):
        swizzle_mx_scales(torch.ones(4, 4, dtype=torch.uint8), axis=axis)
    with pytest.raises(ValueError, match=rf"axis={axis} must be -1 \(rowwise scales\) or 0"):
        unswizzle_mx_scales(torch.ones(128, 4, dtype=torch.uint8), (4, 4), axis=axis)


@pytest.mark.parametrize("axis", [-1, 0])
def test_unswizzle_rejects_wrong_size(axis):
    swizzled = torch.zeros(128, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"swizzled scales hold 512 values; a \[.*\] scale matrix swizzles to"):
        unswizzle_mx_scales(swizzled, (129, 4) if axis == -1 else (4, 129), axis=axis)
