"""``diagnostics/statistics.py`` against hand-computed tables and an independent float64/NumPy
computation."""

import math

import numpy as np
import pytest
import torch

from fp8train.quant import quantize
from fp8train.diagnostics.statistics import clip_ratio, quantization_statistics, sqnr_db

E4M3 = torch.float8_e4m3fn
SQNR_TOLERANCE_DB = 1e-3  # float32 differences and dot products against float64 NumPy


def _numpy_sqnr(reference: np.ndarray, approximation: np.ndarray) -> float:
    reference, approximation = reference.astype(np.float64), approximation.astype(np.float64)
    return 10 * np.log10(np.sum(reference**2) / np.sum((reference - approximation) ** 2))


def test_sqnr_matches_an_independent_float64_computation():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator) * torch.logspace(-2, 2, 64).unsqueeze(1)
    qt = quantize(x, "tensor", dtype=E4M3)
    expected = _numpy_sqnr(x.numpy(), qt.dequantize().numpy())
    stats = quantization_statistics(x, qt)
    assert stats["sqnr_db"] == pytest.approx(expected, abs=SQNR_TOLERANCE_DB)
    assert 25 < stats["sqnr_db"] < 35  # E4M3 keeps 3 mantissa bits


def test_sqnr_edge_values():
    x = torch.tensor([1.0, -2.0, float("nan"), float("inf")])
    assert sqnr_db(x, x) == math.inf  # non-finite reference values are left out
    assert sqnr_db(torch.zeros(3), torch.zeros(3)) == math.inf
    assert sqnr_db(torch.zeros(3), torch.ones(3)) == -math.inf
    assert sqnr_db(torch.ones(2), torch.tensor([1.0, float("nan")])) != sqnr_db(torch.ones(2), torch.ones(2))
    # 10 log10(1 / 0.25^2) = 12.04 dB for a 25% error; 20 dB for 10% (float64 in, float64 sums).
    assert sqnr_db(torch.ones(4), torch.full((4,), 1.25)) == pytest.approx(10 * math.log10(16), abs=1e-9)
    ones = torch.ones(4, dtype=torch.float64)
    assert sqnr_db(ones, torch.full((4,), 1.1, dtype=torch.float64)) == pytest.approx(20.0, abs=1e-9)


def test_underflow_table():
    # Current scaling: scale = 448 / 1000. 1e-3 * 0.448 and 5e-4 * 0.448 lie under half the
    # smallest E4M3 subnormal (2^-10) and flush to zero; 1 does not; 0 is not counted.
    x = torch.tensor([[1000.0, 1.0, 1e-3, 0.0, -5e-4, 3.0, 2.0, 0.5]])
    stats = quantization_statistics(x, quantize(x, "tensor", dtype=E4M3))
    assert stats["underflow_pct"] == pytest.approx(100 * 2 / 7)
    assert stats["saturation_pct"] == 0.0  # the amax lands on 448 exactly: not clipped
    assert stats["amax"] == 1000.0
    assert stats["scale_min"] == stats["scale_max"] == pytest.approx(448 / 1000, rel=1e-6)


def test_saturation_table():
    # A given (delayed) scale of 1: |x| above 464 = 448 + half an ulp (32/2) is clipped;
    # 460 rounds to 448 as any cast would; 448 is exact.
    x = torch.tensor([[1000.0, -500.0, 460.0, 448.0, 1.0, 2.0, 470.0, 0.0]])
    stats = quantization_statistics(x, quantize(x, "tensor", dtype=E4M3, scale=torch.tensor(1.0)))
    assert stats["saturation_pct"] == pytest.approx(100 * 3 / 8)
    assert clip_ratio(448.0, 3) == pytest.approx(464 / 448)
    assert clip_ratio(57344.0, 2) == pytest.approx(61440 / 57344)


def test_nonfinite_values_are_counted_not_compared():
    x = torch.tensor([[1.0, float("nan"), float("inf"), -2.0] * 8])
    stats = quantization_statistics(x, quantize(x, "row", dtype=E4M3))
    assert stats["nonfinite"] == 16
    assert stats["amax"] == 2.0


def test_padded_quantization_and_used_groups_only():
    # Rows of zeros (a padded token dim) have scale 1; the range covers the used groups.
    x = torch.cat([torch.full((3, 32), 2.0), torch.zeros(13, 32)])
    qt = quantize(x, "row", dtype=E4M3, power_2_scales=False)
    stats = quantization_statistics(x[:3], qt)
    assert stats["scale_min"] == stats["scale_max"] == pytest.approx(224.0)
    with pytest.raises(ValueError, match="does not cover x_hp"):
        quantization_statistics(torch.zeros(20, 32), qt)
