"""``fp8_to_hp``: FP8 codes to float32/bfloat16/float16, bit-exact over all 256 codes of
each format and over layouts, against torch's own conversion and ml_dtypes."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train.quant.cast import fp8_to_hp

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

ML_DTYPES = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _all_codes(fp8_dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)


def _assert_same_values(out: torch.Tensor, expected: torch.Tensor):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    int_dtype = INT_VIEW[expected.dtype]
    out_bits = out.contiguous().view(int_dtype)[~nan]
    expected_bits = expected.contiguous().view(int_dtype)[~nan]
    assert torch.equal(out_bits, expected_bits), (out[~nan] != expected[~nan]).nonzero()[:5]


@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
def test_fp8_to_hp_all_codes_bit_exact(fp8_dtype, hp_dtype):
    codes = _all_codes(fp8_dtype)
    out = fp8_to_hp(codes, hp_dtype)
    _assert_same_values(out, codes.to(hp_dtype))
    # Independent check of the values themselves (ml_dtypes decodes the same bytes).
    reference = codes.view(torch.uint8).numpy().view(ML_DTYPES[fp8_dtype]).astype(np.float64)
    np.testing.assert_array_equal(out.to(torch.float64).numpy(), reference)
    if fp8_dtype == E5M2:
        assert torch.isinf(out).sum() == 2 and out[0x7C] == math.inf and out[0xFC] == -math.inf
    assert torch.isnan(out).sum() == (2 if fp8_dtype == E4M3 else 6)


@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
def test_fp8_to_hp_finite_codes_and_layouts(fp8_dtype, hp_dtype):
    codes = _all_codes(fp8_dtype)
    finite = codes[torch.isfinite(codes.to(torch.float32))]  # no NaN/inf: the bit path alone
    _assert_same_values(fp8_to_hp(finite, hp_dtype), finite.to(hp_dtype))
    matrix = codes.reshape(16, 16)
    layouts = {
        "contiguous": matrix,
        "transposed": matrix.t(),
        "strided": matrix[:, ::3],
        "3d": codes.reshape(4, 8, 8).transpose(0, 2),
        "finite_transposed": finite[: (finite.numel() // 16) * 16].reshape(16, -1).t(),
        "empty": matrix[:0],
    }
    for data in layouts.values():
        out = fp8_to_hp(data, hp_dtype)
        _assert_same_values(out.contiguous(), data.to(hp_dtype).contiguous())


def test_fp8_to_hp_default_dtype_is_bfloat16():
    assert fp8_to_hp(_all_codes(E4M3)).dtype == torch.bfloat16


def test_fp8_to_hp_bad_dtypes():
    with pytest.raises(ValueError, match="takes float8_e4m3fn or float8_e5m2 data, got torch.float32"):
        fp8_to_hp(torch.zeros(4), torch.float32)
    with pytest.raises(ValueError, match="got torch.float8_e8m0fnu"):
        fp8_to_hp(torch.zeros(4).to(torch.float8_e8m0fnu))
    for dtype in (torch.float64, torch.int16, E4M3):
        with pytest.raises(ValueError, match=f"converts to float32, bfloat16 or float16, not {dtype}"):
            fp8_to_hp(_all_codes(E4M3), dtype)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_to_hp_finds_a_lone_special_code(fp8_dtype):
    """The NaN/inf fix-up is skipped when no special code is present: each code alone in a
    tensor must still convert exactly (the detection sees positive and negative specials)."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype)
    for code in range(256):
        data = codes[code : code + 1].repeat(5)
        expected = data.to(torch.bfloat16)
        actual = fp8_to_hp(data)
        same_bits = torch.equal(actual.view(torch.int16), expected.view(torch.int16))
        assert same_bits or (actual.isnan().all() and expected.isnan().all()), code


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_to_hp_converts_past_a_chunk_with_specials_on_either_side(fp8_dtype):
    """A tensor of more than one chunk converts chunk by chunk; its special codes, wherever
    they fall, are fixed up as in a tensor of one chunk."""
    from fp8train.quant.cast import CHUNK_ELEMENTS

    codes = torch.arange(256, dtype=torch.uint8).repeat(CHUNK_ELEMENTS // 256 + 2)
    codes[CHUNK_ELEMENTS - 1], codes[CHUNK_ELEMENTS] = 0xFF, 0x7F  # NaN (E5M2: NaN) across the boundary
    data = codes.view(fp8_dtype)
    expected, actual = data.to(torch.float32), fp8_to_hp(data, torch.float32)
    finite = ~expected.isnan()
    assert torch.equal(actual[finite].view(torch.int32), expected[finite].view(torch.int32))
    assert actual[~finite].isnan().all() and int(finite.sum()) < codes.numel()
