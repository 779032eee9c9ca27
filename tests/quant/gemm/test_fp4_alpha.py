"""NVFP4's GEMM ``alpha`` on the host (``fp4_alpha(..., host=True)``, a bound CPU layer's):
the same float32 value as the tensor ops' ``(amax_a * amax_b) / 7225344``, bit for bit, for
an edge table and random amaxes, and the float32 edge cases left to the tensor ops."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fp8train.quant.gemm.fp4 import fp4_alpha

FLOAT32_MAX = float(np.finfo(np.float32).max)
TINY = 2.0**-149  # float32's smallest subnormal
EDGES = [0.0, TINY, 2.0**-126, 1.0, 2688.0, 448.0, 6.0, 3.0e-20, 1.8e19, 1.9e19, 2.0**64, FLOAT32_MAX, math.inf, math.nan]


def _operand(amax: float) -> SimpleNamespace:
    """What ``fp4_alpha`` reads of an operand: its float32 global amax (a CPU scalar)."""
    return SimpleNamespace(global_amax=torch.tensor(amax, dtype=torch.float32))


def _tensor_bits(value) -> int:
    """The float32 bits of ``value`` (a tensor or a Python float holding a float32)."""
    value = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float32)
    assert value.dtype == torch.float32
    return int(value.view(torch.int32))


def _assert_same(a_amax: float, b_amax: float) -> None:
    a, b = _operand(a_amax), _operand(b_amax)
    expected, actual = fp4_alpha(a, b), fp4_alpha(a, b, host=True)
    if isinstance(actual, float):  # a float32 value, exactly
        assert float(np.float32(actual)) == actual or math.isnan(actual)
    if math.isnan(float(expected)):
        assert math.isnan(float(actual)), (a_amax, b_amax, actual)
    else:
        assert _tensor_bits(actual) == _tensor_bits(expected), (a_amax, b_amax, float(expected), float(actual))


@pytest.mark.parametrize("a_amax", EDGES)
@pytest.mark.parametrize("b_amax", EDGES)
def test_host_alpha_is_the_tensor_ops_float32_value(a_amax, b_amax):
    _assert_same(a_amax, b_amax)


def test_host_alpha_for_random_amaxes_across_float32s_range():
    """Random float32 amaxes from subnormal to near the largest, so that products land below,
    inside and above float32's normal range, and quotients in its subnormals."""
    rng = np.random.default_rng(0)
    bits = rng.integers(1, 0x7F7FFFFF, size=(4000, 2), dtype=np.uint32)
    for a_amax, b_amax in bits.view(np.float32).astype(np.float64):
        _assert_same(float(a_amax), float(b_amax))


def test_host_alpha_hand_computed():
    """``2688 * 2688 / 7225344`` is 1 and ``2688 * 1344 / 7225344`` is 0.5, exactly;
    ``1 * 1 / 7225344`` is the float32 nearest 1/7225344 (0x34149B93, as a double's
    rounding to float32 gives it: the double quotient is within far less than half a
    float32 ulp of the exact one, so no second rounding moves it)."""
    assert fp4_alpha(_operand(2688.0), _operand(2688.0), host=True) == 1.0
    assert fp4_alpha(_operand(2688.0), _operand(1344.0), host=True) == 0.5
    assert fp4_alpha(_operand(1.0), _operand(1.0), host=True) == float(np.float32(1.0 / 7225344.0))


def test_host_alpha_none_without_a_global_amax():
    """MXFP4 and the FP8 families have none: no alpha, on the host too."""
    empty = SimpleNamespace(global_amax=None)
    assert fp4_alpha(empty, empty, host=True) is None
