"""``diagnostics/statistics.py`` on 4-bit operands (E2M1 data packed two codes a byte): hand-computed
tables for NVFP4 and MXFP4, and the invariances the packing must not break."""

import math

import pytest
import torch

from fp8train.quant import quantize
from fp8train.quant.e2m1 import pack_e2m1
from fp8train.diagnostics.statistics import clip_ratio, quantization_statistics
from fp8train.quant.tensor import QuantizedTensor

E8M0_ONE = 127  # the E8M0 code of 2^0


def _padded(row: list[float], rows: int) -> torch.Tensor:
    """``row`` over ``rows - 1`` rows of zeros (a quantizer's block must divide both dims;
    zeros are neither flushed nor scaled)."""
    return torch.cat([torch.tensor([row]), torch.zeros(rows - 1, len(row))])


def _hand_sqnr(x: list[float], x_dq: list[float]) -> float:
    signal = sum(v * v for v in x)
    noise = sum((a - b) ** 2 for a, b in zip(x, x_dq))
    return 10 * math.log10(signal / noise)


def test_mxfp4_underflow_table():
    # amax 6: t = 6 * float32(1/6) rounds to 1.0, a power of two, so the scale is 2^0 and the
    # codes are the values rounded to E2M1: 0.25 (a tie) and 0.2 go to 0 (flushed), -0.3 to
    # -0.5, 0.5 and 3 and 6 are exact. 6 non-zero values, 2 flushed.
    row = [6.0, 0.25, 0.2, -0.3, 0.5, 3.0] + [0.0] * 26
    x = _padded(row, 32)
    stats = quantization_statistics(x, quantize(x, "mxfp4"))
    assert stats["underflow_pct"] == pytest.approx(100 * 2 / 6)
    assert stats["saturation_pct"] == 0.0  # the amax lands on 6 exactly
    assert stats["amax"] == 6.0
    assert stats["scale_min"] == stats["scale_max"] == 1.0
    dequantized = [6.0, 0.0, 0.0, -0.5, 0.5, 3.0] + [0.0] * 26
    assert stats["sqnr_db"] == pytest.approx(_hand_sqnr(row, dequantized), abs=1e-4)
    assert stats["nonfinite"] == 0


def test_e2m1_saturation_table():
    # A hand-built MXFP4 tensor whose scale (2^0) is too small for its values: every big
    # value holds the max code (6). |x| above 7 = 6 + half the ulp there (2 / 2) was clipped;
    # 6.5 rounds to 6 as any cast would, 6 is exact.
    x = torch.tensor([[10.0, 6.5, 7.5, -8.0, 6.0, 1.0] + [0.0] * 26])
    codes = torch.tensor([[7, 7, 7, 7 | 8, 7, 2] + [0] * 26], dtype=torch.uint8)
    scale_inv = torch.tensor([[E8M0_ONE]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    qt = QuantizedTensor(data=pack_e2m1(codes, -1), scale_inv=scale_inv, granularity="mxfp4", power_2_scales=True)
    stats = quantization_statistics(x, qt)
    assert stats["saturation_pct"] == pytest.approx(100 * 3 / 32)
    assert clip_ratio(6.0, 1) == pytest.approx(7 / 6)


def test_nvfp4_scales_under_the_global_scale():
    # Three 16-blocks of one row. global_amax = 2688 = 448 * 6, so ge = gd = 1. Block 0:
    # amax 2688, dec = e4m3(2688 / 6) = 448, scale 1/448: 224 -> 0.5 (kept), 112 -> 0.25
    # (a tie: flushed), 100 -> 0.22 (flushed). Block 1: amax 6, dec = 1, scale 1: 0.2
    # flushed. Block 2 is all zero: its scale is not in the range.
    row = [2688.0, 224.0, 112.0, 100.0] + [0.0] * 12 + [6.0, 0.2] + [0.0] * 14 + [0.0] * 16
    x = _padded(row, 16)
    qt = quantize(x, "nvfp4")
    assert float(qt.global_amax) == 2688.0
    stats = quantization_statistics(x, qt)
    assert stats["underflow_pct"] == pytest.approx(100 * 3 / 6)
    assert stats["saturation_pct"] == 0.0
    assert stats["scale_min"] == pytest.approx(1 / 448, rel=1e-6)
    assert stats["scale_max"] == pytest.approx(1.0, rel=1e-6)


def test_nvfp4_global_scale_enters_the_scale_range():
    # One block, amax 12: ge = 2688 / 12 = 224, dec = e4m3(12 * 224 / 6) = 448, and the
    # value-to-code scale is 1 / (dec * gd) = 224 / 448 = 0.5 (12 -> code 6).
    x = _padded([12.0, 6.0, 3.0, 1.0] + [0.0] * 12, 16)
    stats = quantization_statistics(x, quantize(x, "nvfp4"))
    assert stats["scale_min"] == stats["scale_max"] == pytest.approx(0.5, rel=1e-6)
    assert stats["underflow_pct"] == 0.0  # 1 * 0.5 = 0.5, the smallest non-zero code
    # 12, 6, 3, 1 scale to 6, 3, 1.5, 0.5, all codes; only gd = 1/224 rounds in float32.
    assert stats["sqnr_db"] > 120


@pytest.mark.parametrize("granularity", ["nvfp4", "mxfp4"])
def test_columnwise_statistics_equal_rowwise_of_the_transpose(granularity):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=generator) * torch.logspace(-3, 1, 96)
    columnwise = quantization_statistics(x, quantize(x, granularity, axis=0))
    rowwise = quantization_statistics(x.t().contiguous(), quantize(x.t().contiguous(), granularity))
    assert columnwise == pytest.approx(rowwise, rel=1e-6)
    assert columnwise["underflow_pct"] > 0  # four decades within a block: small values flush


def test_nvfp4_2d_and_a_padded_token_dim():
    # Rows 3..31 are a zero-padded token dim: not compared, and their tiles' scales left out.
    x = torch.cat([torch.full((3, 32), 2.0), torch.zeros(29, 32)])
    qt = quantize(x, "nvfp4_2d")
    stats = quantization_statistics(x[:3], qt)
    assert stats["sqnr_db"] == math.inf
    assert stats["underflow_pct"] == 0.0
    # ge = 2688 / 2 = 1344, dec = e4m3(2 * 1344 / 6) = 448: scale = 1344 / 448 = 3 (2 -> code 6).
    assert stats["scale_min"] == stats["scale_max"] == pytest.approx(3.0, rel=1e-6)
    with pytest.raises(ValueError, match="does not cover x_hp"):
        quantization_statistics(torch.zeros(40, 32), qt)
