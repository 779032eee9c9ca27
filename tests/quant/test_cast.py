"""The saturating cast to FP8 and the formats' torch dtypes, checked against NUMERICS.md
section 1 and ml_dtypes: every one of the 256 codes, ties, random bit patterns, specials.

The oracle for ``cast_to_fp8`` is ``np.clip(x_float32, -max, max).astype(ml_dtypes type)``:
ml_dtypes rounds to nearest-even like the contract but does not saturate, so the clip
supplies the saturation (it keeps NaN, and +-max is exact in float32).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train.quant.cast import cast_scratch_to_fp8, cast_to_fp8, format_of, torch_dtype
from fp8train.spec.formats import E4M3, E5M2, E8M0, Format

from ..helpers.nonsaturating_cast import NonSaturatingFP8Conversion

NUM_RANDOM_FLOAT32 = 1_000_000
SEED = 20240611

# (torch dtype, ml_dtypes type, largest finite) for the two data formats.
DATA_FORMATS = [
    pytest.param(torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0, id="e4m3"),
    pytest.param(torch.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0, id="e5m2"),
]
SOURCE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _oracle_bits(x_f32: np.ndarray, ml_type, fp8_max: float) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.clip(x_f32, -fp8_max, fp8_max).astype(ml_type).view(np.uint8)


def _assert_cast_matches_oracle(x: torch.Tensor, dtype: torch.dtype, ml_type, fp8_max: float) -> None:
    """Cast ``x`` with the library and compare bit for bit with the oracle.

    NaN inputs: torch and ml_dtypes pick different NaN codes (e.g. sign and payload), so
    for those positions only "the output is NaN" is asserted; every other position must
    match bit for bit.
    """
    out = cast_to_fp8(x, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    x_f32 = x.to(torch.float32).numpy()  # exact from bf16 and fp16
    expected = _oracle_bits(x_f32, ml_type, fp8_max)
    actual = out.view(torch.uint8).numpy()
    nan_in = np.isnan(x_f32)
    assert torch.isnan(out.float()).numpy()[nan_in].all(), "NaN input must give NaN"
    mismatch = np.flatnonzero((actual != expected) & ~nan_in)
    if mismatch.size:
        i = mismatch[0]
        pytest.fail(
            f"{mismatch.size} mismatches; first: x={x_f32.ravel()[i]!r} "
            f"(bits {x_f32.view(np.uint32).ravel()[i]:#010x}) -> {actual.ravel()[i]:#04x}, "
            f"expected {expected.ravel()[i]:#04x}"
        )


def _all_codes_f32(ml_type) -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(ml_type).astype(np.float32)


# ---------------------------------------------------------------- formats as torch dtypes


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E8M0], ids=lambda f: f.name)
def test_format_properties_match_torch_finfo(fmt):
    finfo = torch.finfo(torch_dtype(fmt))
    assert fmt.bits == finfo.bits
    assert fmt.max == finfo.max
    assert fmt.min == finfo.min
    assert fmt.smallest_normal == finfo.smallest_normal
    assert fmt.tiny == finfo.tiny
    assert fmt.eps == finfo.eps


@pytest.mark.parametrize(
    "fmt, ml_type",
    [(E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2), (E8M0, ml_dtypes.float8_e8m0fnu)],
    ids=["E4M3", "E5M2", "E8M0"],
)
def test_format_max_and_smallest_are_the_extreme_codes(fmt, ml_type):
    values = _all_codes_f32(ml_type).astype(np.float64)
    finite = values[np.isfinite(values)]
    assert finite.max() == fmt.max
    positive = finite[finite > 0]
    assert positive.min() == (fmt.smallest_subnormal or fmt.smallest_normal)


@pytest.mark.parametrize(
    "fmt, has_inf, num_nan_codes",
    [(E4M3, False, 2), (E5M2, True, 6), (E8M0, False, 1)],
    ids=["E4M3", "E5M2", "E8M0"],
)
def test_format_special_values_match_table(fmt, has_inf, num_nan_codes):
    values = torch.arange(256, dtype=torch.uint8).view(torch_dtype(fmt)).float()
    assert fmt.has_infinities == has_inf
    assert int(torch.isinf(values).sum()) == (2 if has_inf else 0)
    assert int(torch.isnan(values).sum()) == num_nan_codes


def test_format_enum_dtypes_per_role():
    assert torch_dtype(Format.E4M3.forward) == torch.float8_e4m3fn
    assert torch_dtype(Format.E4M3.backward) == torch.float8_e4m3fn
    assert torch_dtype(Format.E5M2.forward) == torch.float8_e5m2
    assert torch_dtype(Format.E5M2.backward) == torch.float8_e5m2
    assert torch_dtype(Format.HYBRID.forward) == torch.float8_e4m3fn
    assert torch_dtype(Format.HYBRID.backward) == torch.float8_e5m2
    assert {f.name for f in Format} == {"E4M3", "E5M2", "HYBRID"}


def test_format_of_each_dtype():
    assert format_of(torch.float8_e4m3fn) is E4M3
    assert format_of(torch.float8_e5m2) is E5M2
    assert format_of(torch.float8_e8m0fnu) is E8M0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fnuz])
def test_format_of_rejects_other_dtypes(dtype):
    with pytest.raises(ValueError, match=rf"dtype {dtype} is not an fp8train format"):
        format_of(dtype)


def test_e8m0_all_codes_decode_like_ml_dtypes():
    decoded = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).float().numpy()
    expected = _all_codes_f32(ml_dtypes.float8_e8m0fnu)
    assert np.isnan(decoded[255]) and np.isnan(expected[255])
    np.testing.assert_array_equal(decoded[:255].view(np.uint32), expected[:255].view(np.uint32))
    # Code c is 2^(c - 127): 0 -> 2^-127 (a float32 subnormal), 127 -> 1, 254 -> 2^127.
    assert decoded[0] == 2.0**-127 and decoded[127] == 1.0 and decoded[254] == 2.0**127


# ---------------------------------------------------------------- cast_to_fp8 vs ml_dtypes


@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
def test_cast_all_codes_round_trip(dtype, ml_type, fp8_max):
    codes_f32 = _all_codes_f32(ml_type)
    _assert_cast_matches_oracle(torch.from_numpy(codes_f32), dtype, ml_type, fp8_max)
    # Every finite code maps back to itself (inf saturates, so it is excluded).
    out = cast_to_fp8(torch.from_numpy(codes_f32), dtype).view(torch.uint8).numpy()
    finite = np.isfinite(codes_f32)
    np.testing.assert_array_equal(out[finite], np.arange(256, dtype=np.uint8)[finite])


def _neighbour_midpoints(ml_type, fp8_max: float) -> np.ndarray:
    values = np.unique(_all_codes_f32(ml_type).astype(np.float64))
    values = values[np.isfinite(values)]
    # The would-be next codes above +-max, so the saturation boundary is a midpoint too.
    next_up = {448.0: 480.0, 57344.0: 65536.0}[fp8_max]
    values = np.concatenate([[-next_up], values, [next_up]])
    midpoints = (values[:-1] + values[1:]) / 2
    midpoints_f32 = midpoints.astype(np.float32)
    assert np.array_equal(midpoints_f32.astype(np.float64), midpoints), "midpoints must be exact in float32"
    # Also one float32 ulp either side of every midpoint.
    return np.concatenate(
        [
            midpoints_f32,
            np.nextafter(midpoints_f32, np.float32(np.inf)),
            np.nextafter(midpoints_f32, np.float32(-np.inf)),
        ]
    )


@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
@pytest.mark.parametrize("source_dtype", SOURCE_DTYPES, ids=str)
def test_cast_midpoints_round_ties_to_even(dtype, ml_type, fp8_max, source_dtype):
    x = torch.from_numpy(_neighbour_midpoints(ml_type, fp8_max))
    if source_dtype != torch.float32:
        # Keep only the midpoints the source dtype holds exactly, so the cast sees a tie.
        x = x[x.to(source_dtype).float() == x].to(source_dtype)
    assert x.numel() > 0
    _assert_cast_matches_oracle(x, dtype, ml_type, fp8_max)


@pytest.mark.parametrize(
    "dtype, value, expected",
    [
        # E4M3 near 1 has spacing 1/8: ties go to the even mantissa.
        (torch.float8_e4m3fn, 1.0625, 1.0),
        (torch.float8_e4m3fn, 1.1875, 1.25),
        (torch.float8_e4m3fn, -1.0625, -1.0),
        # subnormal spacing 2^-9: 1.5 * 2^-9 is a tie between codes 1 and 2 -> 2
        (torch.float8_e4m3fn, 1.5 * 2.0**-9, 2 * 2.0**-9),
        (torch.float8_e4m3fn, 0.5 * 2.0**-9, 0.0),
        # between 416 and 448 (spacing 32): the tie 432 goes to 448 (mantissa 110)
        (torch.float8_e4m3fn, 432.0, 448.0),
        (torch.float8_e4m3fn, 464.0, 448.0),  # tie with the would-be 480: saturates
        (torch.float8_e4m3fn, 1e30, 448.0),
        (torch.float8_e5m2, 1.125, 1.0),
        (torch.float8_e5m2, 1.375, 1.5),
        (torch.float8_e5m2, 61440.0, 57344.0),
        (torch.float8_e5m2, -1e30, -57344.0),
    ],
)
def test_cast_hand_picked_values(dtype, value, expected):
    out = cast_to_fp8(torch.tensor([value], dtype=torch.float32), dtype)
    assert out.float().item() == expected


@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
def test_cast_random_float32_bit_patterns(dtype, ml_type, fp8_max):
    rng = np.random.default_rng(SEED)
    bits = rng.integers(0, 2**32, size=NUM_RANDOM_FLOAT32, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    _assert_cast_matches_oracle(torch.from_numpy(x), dtype, ml_type, fp8_max)


@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
def test_cast_random_float32_in_fp8_range(dtype, ml_type, fp8_max):
    # Uniform random bit patterns are mostly far outside the FP8 range: also cover the
    # exponents the format actually uses (and a few binades either side) densely.
    rng = np.random.default_rng(SEED + 1)
    max_exponent = int(np.log2(fp8_max)) + 2
    exponent = rng.integers(-30, max_exponent, size=NUM_RANDOM_FLOAT32 // 4)
    mantissa = rng.integers(0, 2**23, size=exponent.size)
    sign = rng.integers(0, 2, size=exponent.size)
    bits = (sign << 31) | ((exponent + 127) << 23) | mantissa
    x = bits.astype(np.uint32).view(np.float32)
    _assert_cast_matches_oracle(torch.from_numpy(x), dtype, ml_type, fp8_max)


@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cast_every_16_bit_pattern(dtype, ml_type, fp8_max, source_dtype):
    x = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(source_dtype)
    _assert_cast_matches_oracle(x, dtype, ml_type, fp8_max)


def _special_values(ml_type, fp8_max: float) -> np.ndarray:
    f32 = np.float32
    max_ = f32(fp8_max)
    next_up = {448.0: 480.0, 57344.0: 65536.0}[fp8_max]
    positive_codes = _all_codes_f32(ml_type)[:128]
    fp8_subnormals = positive_codes[1 : 2 ** ml_dtypes.finfo(ml_type).nmant]
    f32_subnormals = np.array([1, 2, 3, 0x1234, 0x400000, 0x7FFFFF], dtype=np.uint32).view(np.float32)
    values = [
        0.0,
        np.inf,
        np.nextafter(max_, f32(np.inf)),
        f32((fp8_max + next_up) / 2),
        np.nextafter(f32((fp8_max + next_up) / 2), f32(0)),
        f32(next_up),
        f32(1e30),
        np.finfo(np.float32).max,
        np.finfo(np.float32).tiny,
        *fp8_subnormals,
        *f32_subnormals,
    ]
    values = np.array(values, dtype=np.float32)
    return np.concatenate([values, -values])


@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
def test_cast_special_values(dtype, ml_type, fp8_max):
    x = torch.from_numpy(_special_values(ml_type, fp8_max))
    _assert_cast_matches_oracle(x, dtype, ml_type, fp8_max)


@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
def test_cast_saturates_and_keeps_signed_zero(dtype, ml_type, fp8_max):
    x = torch.tensor([0.0, -0.0, np.inf, -np.inf, 1e30, -1e30, fp8_max * 1.0001, -fp8_max * 1.0001])
    out = cast_to_fp8(x, dtype)
    assert out.view(torch.uint8).tolist()[:2] == [0x00, 0x80]
    assert out.float().tolist()[2:] == [fp8_max, -fp8_max] * 3
    assert not torch.isinf(out.float()).any()


@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
@pytest.mark.parametrize("source_dtype", SOURCE_DTYPES, ids=str)
def test_cast_nan_stays_nan(dtype, ml_type, fp8_max, source_dtype):
    # Any NaN input (quiet, signalling, negative) gives a NaN output; which NaN code is
    # not specified (torch and ml_dtypes differ), so only NaN-ness is checked.
    nan_bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF], dtype=np.uint32)
    x = torch.from_numpy(nan_bits.view(np.float32)).to(source_dtype)
    assert torch.isnan(x).all()
    assert torch.isnan(cast_to_fp8(x, dtype).float()).all()


@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
@pytest.mark.parametrize("source_dtype", SOURCE_DTYPES, ids=str)
def test_cast_special_values_from_16_bit_sources(dtype, ml_type, fp8_max, source_dtype):
    x = torch.tensor([0.0, -0.0, np.inf, -np.inf, 3.0, -0.3, 1000.0, 60000.0], dtype=source_dtype)
    _assert_cast_matches_oracle(x, dtype, ml_type, fp8_max)


def test_cast_keeps_shape_and_accepts_non_contiguous():
    x = torch.linspace(-500, 500, 24, dtype=torch.float32).reshape(2, 3, 4).transpose(0, 2)
    out = cast_to_fp8(x, torch.float8_e4m3fn)
    assert out.shape == (4, 3, 2)
    assert torch.equal(out.view(torch.uint8), cast_to_fp8(x.contiguous(), torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float16, torch.int8, torch.float8_e4m3fnuz])
def test_cast_rejects_bad_target_dtype(dtype):
    with pytest.raises(ValueError, match=rf"dtype {dtype} is not an FP8 data format"):
        cast_to_fp8(torch.ones(3), dtype)


@pytest.mark.parametrize("source_dtype", [torch.int32, torch.float64, torch.float8_e4m3fn, torch.uint8])
def test_cast_rejects_bad_source_dtype(source_dtype):
    x = torch.ones(3).to(source_dtype)
    with pytest.raises(ValueError, match=rf"float32, bfloat16 or float16 input, got {source_dtype}"):
        cast_to_fp8(x, torch.float8_e4m3fn)


# ------------------------------------------- without PyTorch's own saturation (CUDA, torch < 2.12)


def test_the_nonsaturating_conversion_models_cuda():
    # The harness itself: a plain conversion under it gives what the H200 gave (448 for 447
    # and 449, NaN for 470, 480, 500, 1e6 and inf), so the tests below would see the bug.
    x = torch.tensor([447.0, 449.0, 464.0, 470.0, 480.0, 500.0, 1e6, np.inf, -np.inf, -470.0])
    with NonSaturatingFP8Conversion() as conversion:
        out = x.to(torch.float8_e4m3fn).float()
    assert out[:3].tolist() == [448.0, 448.0, 448.0]
    assert torch.isnan(out[3:]).all()
    assert conversion.num_nan_made == 7


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cast_saturates_every_16_bit_pattern_without_torchs_saturation(source_dtype):
    x = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(source_dtype)
    with NonSaturatingFP8Conversion() as conversion:
        _assert_cast_matches_oracle(x, torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0)
    assert conversion.num_conversions == 1


def test_cast_saturates_float32_specials_without_torchs_saturation():
    specials = torch.from_numpy(_special_values(ml_dtypes.float8_e4m3fn, 448.0))
    wide = torch.from_numpy(np.random.default_rng(SEED).uniform(-1e4, 1e4, 100_000).astype(np.float32))
    with NonSaturatingFP8Conversion():
        _assert_cast_matches_oracle(torch.cat([specials, wide]), torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0)


@pytest.mark.parametrize("source_dtype", SOURCE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype, ml_type, fp8_max", DATA_FORMATS)
def test_the_scratch_cast_equals_the_cast_and_only_it_overwrites(dtype, ml_type, fp8_max, source_dtype):
    # quantize's cast of its own `x * scale` clamps in place; the public cast leaves x alone.
    x = torch.from_numpy(_special_values(ml_type, fp8_max)).to(source_dtype)
    original = x.clone()
    with NonSaturatingFP8Conversion():
        expected = cast_to_fp8(x, dtype)
        assert torch.equal(x.view(torch.uint8), original.view(torch.uint8)), "cast_to_fp8 changed its input"
        actual = cast_scratch_to_fp8(x, dtype)
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
    assert x.abs().max() <= fp8_max
