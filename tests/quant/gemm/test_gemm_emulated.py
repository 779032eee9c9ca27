"""scaled_mm's emulated backend against float64 GEMMs of the dequantized operands
(NUMERICS.md section 4): every recipe pairing, bias, per-chunk promotion, and the grad
GEMMs through ``transpose``."""

from __future__ import annotations

import pytest
import torch

from fp8train.quant.gemm.emulated import chunked_mm
from fp8train.quant.gemm import scaled_mm
from fp8train.quant import quantize
from fp8train.quant.tensor import QuantizedTensor, transpose

from .._gemm_reference import (
    DTYPE_PAIRS,
    E4M3,
    E5M2,
    MAX_REL_ERR_F32,
    OUT_DTYPES,
    OUT_ROUNDING,
    SHAPES,
    _assert_matches,
    _chunked_reference,
    _dequantize_f64,
    _p2_cases,
    _pair,
    _quantize,
    _random,
    _reference,
)


# ---------------------------------------------------------------- emulated vs float64


def _dtype_cases():
    """Every output dtype with E4M3 operands; the E5M2 pairings with float32 output."""
    for dtypes in DTYPE_PAIRS:
        for out_dtype in OUT_DTYPES if dtypes == (E4M3, E4M3) else (torch.float32,):
            name = f"{dtypes[0]}x{dtypes[1]}-{out_dtype}".replace("torch.float8_", "").replace("torch.", "")
            yield pytest.param(dtypes, out_dtype, id=name)


@pytest.mark.parametrize("dtypes, out_dtype", list(_dtype_cases()))
@pytest.mark.parametrize("a_gran, b_gran, power_2_scales", list(_p2_cases()))
def test_emulated_matches_float64_gemm(a_gran, b_gran, power_2_scales, dtypes, out_dtype):
    a, b = _pair(a_gran, b_gran, dtypes, power_2_scales)
    if not power_2_scales:
        # The case must exercise arbitrary float32 scales, not powers of two by luck.
        mantissas = a.scale_inv.to(torch.float32).view(torch.int32) & 0x7FFFFF
        assert (mantissas != 0).any()
    out = scaled_mm(a, b, out_dtype, backend="emulated")
    assert out.shape == (a.data.shape[0], b.data.shape[0])
    _assert_matches(out, _reference(a, b), out_dtype)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("a_gran, b_gran, power_2_scales", list(_p2_cases()))
def test_emulated_ignores_an_ambient_autocast(a_gran, b_gran, power_2_scales, autocast_dtype):
    # torch.compile traces an autograd.Function's backward under the forward's autocast:
    # the emulation's GEMMs must keep their own dtypes (float32 for arbitrary scales), or
    # the sum is rounded to bfloat16/float16 before the scales are applied.
    a, b = _pair(a_gran, b_gran, (E4M3, E4M3), power_2_scales)
    bias = torch.randn(b.data.shape[0], generator=torch.Generator().manual_seed(3))
    for out_dtype in (torch.float32, torch.bfloat16):
        expected = scaled_mm(a, b, out_dtype, backend="emulated", bias=bias)
        with torch.autocast("cpu", dtype=autocast_dtype):
            out = scaled_mm(a, b, out_dtype, backend="emulated", bias=bias)
        assert out.dtype == out_dtype and torch.equal(out, expected)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("a_gran, b_gran, power_2_scales", list(_p2_cases()))
def test_emulated_with_bias(a_gran, b_gran, power_2_scales, out_dtype):
    """The bias is added: within the rounding(s) of the GEMM and of the sum."""
    a, b = _pair(a_gran, b_gran, power_2_scales=power_2_scales, seed=7)
    bias = (10 * torch.randn(b.data.shape[0], generator=torch.Generator().manual_seed(3))).to(out_dtype)
    out = scaled_mm(a, b, out_dtype, backend="emulated", bias=bias)
    gemm_ref = _reference(a, b)
    bias_f64 = bias.to(torch.float64).reshape(1, -1)
    # One rounding of the GEMM's float32 value plus the bias (as the hardware does).
    magnitude = gemm_ref.abs() + (gemm_ref + bias_f64).abs()
    _assert_matches(out, gemm_ref + bias_f64, out_dtype, magnitude=magnitude)
    # Without the bias the output differs (so the check above sees the bias at all).
    assert not torch.equal(out, scaled_mm(a, b, out_dtype, backend="emulated"))


@pytest.mark.parametrize(
    "out_dtype",
    [torch.float32, torch.bfloat16, torch.float16],
    ids=str,
)
@pytest.mark.parametrize("a_gran, b_gran", [("row", "row"), ("block1x128", "block128x128"), ("mx", "mx")])
def test_emulated_bias_is_added_before_the_output_rounding(a_gran, b_gran, out_dtype):
    """``round(gemm + bias)``, one rounding, as the hardware epilogue does. A bias that
    cancels the GEMM's leading bits exposes a rounding before the add."""
    a, b = _pair(a_gran, b_gran, seed=13)
    gemm_ref = _reference(a, b)
    bias = -gemm_ref[0].to(out_dtype)  # row 0 of the result is only the rounding residual
    out = scaled_mm(a, b, out_dtype, backend="emulated", bias=bias)
    ref = gemm_ref + bias.to(torch.float64).reshape(1, -1)
    assert ref[0].abs().max() > 0
    bound = OUT_ROUNDING[out_dtype] * ref.abs() + MAX_REL_ERR_F32 * gemm_ref.abs().max()
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "a_gran, b_gran",
    [("block1x128", "block128x128"), ("block1x128", "block1x128"), ("block128x128", "block1x128")],
)
def test_non_power_of_2_block_scales_follow_per_chunk_promotion(a_gran, b_gran, out_dtype):
    a, b = _pair(a_gran, b_gran, dtypes=(E4M3, E5M2), power_2_scales=False, seed=11)
    assert not a.power_2_scales and not b.power_2_scales
    ref = _chunked_reference(a, b, 128)
    # The chunk loop itself, then the public entry point that must route to it.
    torch.testing.assert_close(
        chunked_mm(a, b, 128).double(), ref, rtol=0, atol=MAX_REL_ERR_F32 * ref.abs().max().item()
    )
    _assert_matches(scaled_mm(a, b, out_dtype, backend="emulated"), ref, out_dtype)


def test_chunk_scales_are_applied_per_chunk():
    """A chunk loop that used one scale per row (the mean, the first chunk's) would not
    match: make the chunk scales differ by orders of magnitude."""
    m, n, k = SHAPES["block"]
    x = _random((m, k), 21) * torch.logspace(-3, 3, k // 128).repeat_interleave(128).reshape(1, k)
    a = quantize(x, "block1x128", power_2_scales=False)
    b = quantize(_random((n, k), 22), "block128x128", power_2_scales=False)
    ref = _chunked_reference(a, b, 128)
    _assert_matches(scaled_mm(a, b, torch.float32, backend="emulated"), ref, torch.float32)
    first_chunk_only = _chunked_reference(
        QuantizedTensor(a.data, a.scale_inv[:, :1].expand_as(a.scale_inv).contiguous(), "block1x128"), b, 128
    )
    assert (first_chunk_only - ref).abs().max() > 1e-2 * ref.abs().max()


# ---------------------------------------------------------------- grad GEMMs via transpose

# (granularity of dy, of x) for dW = dy^T @ x; both quantized along M (axis=0).
GRAD_WEIGHT_CASES = [
    ("tensor", "tensor", (200, 136, 328)),
    ("row", "row", (200, 136, 328)),
    ("block1x128", "block1x128", (384, 256, 128)),
    ("block1x128", "block128x128", (256, 128, 384)),
    ("mx", "mx", (160, 96, 224)),
]


@pytest.mark.parametrize(
    "dy_gran, x_gran, shape, power_2_scales",
    [
        pytest.param(dy, x, shape, p2, id=f"{dy}x{x}-p2={p2}")
        for dy, x, shape in GRAD_WEIGHT_CASES
        for p2 in ((True,) if dy == "mx" else (True, False))
    ],
)
def test_grad_weight_gemm_through_transpose(dy_gran, x_gran, shape, power_2_scales):
    m, n, k = shape
    dy = _quantize(_random((m, n), 31), dy_gran, E5M2, power_2_scales, axis=0)
    x = _quantize(_random((m, k), 32), x_gran, E4M3, power_2_scales, axis=0)
    dy_t, x_t = transpose(dy), transpose(x)
    for original, transposed in ((dy, dy_t), (x, x_t)):
        assert transposed.data.shape == original.data.shape[::-1]
        assert torch.equal(transposed.data.view(torch.uint8), original.data.view(torch.uint8).t())
        if original.granularity not in ("tensor", "block128x128"):
            assert transposed.axis == -1
    out = scaled_mm(dy_t, x_t, torch.float32, backend="emulated")
    # Reference: dequantize in the original orientation, transpose in float64.
    ref = _dequantize_f64(dy).T @ _dequantize_f64(x)
    assert out.shape == (n, k)
    _assert_matches(out, ref, torch.float32)


def test_grad_input_gemm_reuses_transposed_128x128_tiles():
    """blockwise grad_input: dy (1x128 along N) @ W, with W's 128x128 tiles transposed."""
    m, n, k = 256, 384, 128
    dy = quantize(_random((m, n), 41), "block1x128", dtype=E5M2)
    w = quantize(_random((n, k), 42), "block128x128")
    w_t = transpose(w)
    assert w_t.scale_inv.shape == (k // 128, n // 128)
    out = scaled_mm(dy, w_t, torch.float32, backend="emulated")
    ref = _dequantize_f64(dy) @ _dequantize_f64(w)
    _assert_matches(out, ref, torch.float32)


def test_transpose_of_3d_tensor_uses_its_2d_view():
    x = quantize(_random((96, 64), 43).reshape(3, 32, 64), "row", axis=0)
    x_t = transpose(x)
    assert x_t.data.shape == (64, 96) and x_t.scale_inv.shape == (64, 1) and x_t.axis == -1
    assert torch.equal(x_t.data.view(torch.uint8), x.data.reshape(96, 64).view(torch.uint8).t())
