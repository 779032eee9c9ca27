"""FP8 format facts (FloatFormat and its properties) against the table in NUMERICS.md
section 1 and ``ml_dtypes.finfo``. The spec is torch-free: casts, torch dtypes and the
256 codes of each format are checked in tests/quant/test_cast.py."""

from __future__ import annotations

import ml_dtypes
import pytest

from fp8train.spec.formats import E2M1, E4M3, E5M2, E8M0, FloatFormat

# ---------------------------------------------------------------- FloatFormat facts


@pytest.mark.parametrize(
    "fmt, bias, max_, smallest_normal, smallest_subnormal, eps",
    [
        (E4M3, 7, 448.0, 2.0**-6, 2.0**-9, 2.0**-3),
        (E5M2, 15, 57344.0, 2.0**-14, 2.0**-16, 2.0**-2),
        (E8M0, 127, 2.0**127, 2.0**-127, None, 1.0),
        (E2M1, 1, 6.0, 1.0, 0.5, 0.5),
    ],
    ids=["E4M3", "E5M2", "E8M0", "E2M1"],
)
def test_format_properties_match_numerics_table(fmt, bias, max_, smallest_normal, smallest_subnormal, eps):
    assert isinstance(fmt, FloatFormat)
    assert fmt.bits == (4 if fmt is E2M1 else 8)
    assert fmt.bias == bias
    assert fmt.max == max_
    assert fmt.smallest_normal == smallest_normal
    assert fmt.tiny == smallest_normal
    assert fmt.smallest_subnormal == smallest_subnormal
    assert fmt.eps == eps
    # Signed formats are symmetric; unsigned E8M0's smallest value is 2^-127.
    assert fmt.min == (smallest_normal if fmt is E8M0 else -max_)


@pytest.mark.parametrize(
    "fmt, ml_type",
    [(E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2), (E2M1, ml_dtypes.float4_e2m1fn)],
    ids=["E4M3", "E5M2", "E2M1"],
)
def test_format_properties_match_ml_dtypes_finfo(fmt, ml_type):
    finfo = ml_dtypes.finfo(ml_type)
    assert fmt.max == float(finfo.max)
    assert fmt.smallest_normal == float(finfo.smallest_normal)
    assert fmt.smallest_subnormal == float(finfo.smallest_subnormal)
    assert fmt.eps == float(finfo.eps)
    assert fmt.bits == finfo.bits


def test_e2m1_is_the_packed_pytorch_dtype_without_nan():
    # PyTorch names the packed dtype (two values a byte); ml_dtypes and JAX the unpacked one.
    assert E2M1.dtype_name == "float4_e2m1fn_x2"
    assert not E2M1.has_nan and not E2M1.has_infinities and E2M1.has_subnormals
    assert E4M3.has_nan and E8M0.has_nan

