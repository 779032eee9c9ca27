"""scaled_mm against float64 GEMMs of the dequantized operands (NUMERICS.md section 4):
every recipe pairing, per-chunk promotion, grad GEMMs through ``transpose``, the CPU
``torch._scaled_mm`` path, hardware scale layouts, backend selection, errors, and
``fp8_to_hp`` over all 256 codes."""

from __future__ import annotations

import logging
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8train
from fp8train import QuantizedTensor, quantize, scaled_mm, swizzle_mx_scales
from fp8train import gemm as gemm_module
from fp8train.gemm import fp8_to_hp, transpose

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

# float32 out: error relative to max|ref| (float32 accumulation of K exact products).
MAX_REL_ERR_F32 = 1e-6
# One rounding to the output dtype, relative to |ref| (unit roundoff 2^-p).
OUT_ROUNDING = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
BF16_MANTISSA_BITS = 7

# (M, N, K) per recipe family: not multiples of 512; block dims multiples of 128, MX of 32
# (K/32 = 13 so the swizzle pads its columns), tensor/row dims anything.
SHAPES = {"tensor": (200, 136, 328), "row": (200, 136, 328), "block": (256, 128, 384), "mx": (160, 96, 416)}
HARDWARE_SHAPE = (96, 144, 320)  # multiples of 16, as torch._scaled_mm needs

PAIRINGS = [
    ("tensor", "tensor"),  # tensorwise / delayed
    ("row", "row"),  # rowwise
    ("row", "tensor"),  # rowwise_with_gw_hp grad_input: grad_output rows x weight tensor
    ("tensor", "row"),
    ("block1x128", "block128x128"),  # blockwise output / grad_input
    ("block1x128", "block1x128"),  # blockwise grad_weight
    ("block128x128", "block1x128"),  # BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    ("mx", "mx"),
]
DTYPE_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Granularities whose scales may be arbitrary float32 (power_2_scales=False possible).
NON_P2_CAPABLE = ("tensor", "row", "block1x128", "block128x128")


def _family(granularity: str) -> str:
    return "block" if granularity.startswith("block") else granularity


def _shape(a_gran: str, b_gran: str) -> tuple[int, int, int]:
    families = {_family(a_gran), _family(b_gran)}
    for family in ("block", "mx", "row", "tensor"):
        if family in families:
            return SHAPES[family]
    raise AssertionError(families)


def _random(shape, seed: int) -> torch.Tensor:
    """Normal values whose magnitude varies by row and by column, so row, block and chunk
    scales all differ (and are not powers of two unless rounded)."""
    generator = torch.Generator().manual_seed(seed)
    rows, cols = shape
    row_scale = torch.exp(torch.randn(rows, 1, generator=generator))
    col_scale = torch.exp(0.7 * torch.randn(1, cols, generator=generator))
    # 1/8 keeps every GEMM result well inside float16's range.
    return torch.randn(rows, cols, generator=generator) * row_scale * col_scale / 8


def _quantize(x: torch.Tensor, granularity: str, dtype: torch.dtype, power_2_scales: bool, axis: int = -1):
    p2 = None if granularity == "mx" else power_2_scales
    return quantize(x, granularity, dtype=dtype, power_2_scales=p2, axis=axis)


def _scale_inv_f64(qt: QuantizedTensor) -> torch.Tensor:
    """Compact scale_inv of a 2-D tensor expanded to the data's shape, float64 (one
    scale per ``rows/R x cols/C`` group for ``R x C`` scales, any axis)."""
    rows, cols = qt.data.shape
    scale_inv = qt.scale_inv.to(torch.float32).to(torch.float64)
    scale_inv = scale_inv.reshape(1, 1) if scale_inv.dim() == 0 else scale_inv
    group_rows, group_cols = rows // scale_inv.shape[0], cols // scale_inv.shape[1]
    return scale_inv.repeat_interleave(group_rows, dim=0).repeat_interleave(group_cols, dim=1)


def _dequantize_f64(qt: QuantizedTensor) -> torch.Tensor:
    """``data * scale_inv`` in float64 from the raw codes (independent of the library)."""
    return qt.data.to(torch.float32).to(torch.float64) * _scale_inv_f64(qt)


def _reference(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    return _dequantize_f64(a) @ _dequantize_f64(b).T


def _chunked_reference(a: QuantizedTensor, b: QuantizedTensor, chunk: int) -> torch.Tensor:
    """The literal per-chunk promotion in float64: each chunk's partial product of the raw
    FP8 values times the two operands' chunk scales, summed over chunks."""
    a_values = a.data.to(torch.float32).to(torch.float64)
    b_values = b.data.to(torch.float32).to(torch.float64)
    a_scales, b_scales = _scale_inv_f64(a), _scale_inv_f64(b)
    out = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float64)
    for start in range(0, a.data.shape[1], chunk):
        k = slice(start, start + chunk)
        # Scales are constant inside a chunk: read them at the chunk's first column.
        a_scale = a_scales[:, start : start + 1]
        b_scale = b_scales[:, start].reshape(1, -1)
        out += (a_values[:, k] @ b_values[:, k].T) * a_scale * b_scale
    return out


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype, *, magnitude=None):
    """``|out - ref| <= u(out_dtype) * magnitude + MAX_REL_ERR_F32 * max|ref|``: one rounding
    to a 16-bit ``out_dtype`` plus float32 accumulation error.

    ``magnitude`` defaults to ``|ref|``; pass a larger one to allow several roundings."""
    assert out.dtype == out_dtype
    out = out.to(torch.float64)
    magnitude = ref.abs() if magnitude is None else magnitude
    scale = ref.abs().max()
    assert scale > 0
    if out_dtype == torch.float32:
        bound = MAX_REL_ERR_F32 * scale
    else:
        bound = OUT_ROUNDING[out_dtype] * magnitude + MAX_REL_ERR_F32 * scale
    excess = (out - ref).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} of {excess.numel()} values off; worst at {divmod(worst, out.shape[1])}: "
        f"out={out.flatten()[worst].item()!r} ref={ref.flatten()[worst].item()!r}"
    )


def _pair(a_gran, b_gran, dtypes=(E4M3, E4M3), power_2_scales=True, seed=0):
    m, n, k = _shape(a_gran, b_gran)
    a = _quantize(_random((m, k), seed), a_gran, dtypes[0], power_2_scales)
    b = _quantize(_random((n, k), seed + 1), b_gran, dtypes[1], power_2_scales)
    return a, b


def _p2_cases():
    for a_gran, b_gran in PAIRINGS:
        p2_options = (True, False) if a_gran in NON_P2_CAPABLE and b_gran in NON_P2_CAPABLE else (True,)
        for p2 in p2_options:
            yield pytest.param(a_gran, b_gran, p2, id=f"{a_gran}x{b_gran}-p2={p2}")


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
        gemm_module._chunked_mm(a, b, 128).double(), ref, rtol=0, atol=MAX_REL_ERR_F32 * ref.abs().max().item()
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


# ---------------------------------------------------------------- hardware path on CPU


def _bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at each value's magnitude (float64), at least the subnormal spacing."""
    magnitude = values.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - BF16_MANTISSA_BITS)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_cpu_scaled_mm_matches_emulated(granularity, power_2_scales, out_dtype, with_bias):
    m, n, k = HARDWARE_SHAPE
    a = quantize(_random((m, k), 51), granularity, power_2_scales=power_2_scales)
    b = quantize(_random((n, k), 52), granularity, power_2_scales=power_2_scales)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(out_dtype) if with_bias else None
    hardware = gemm_module._hardware_mm(a, b, out_dtype, bias)
    emulated = scaled_mm(a, b, out_dtype, backend="emulated", bias=bias)
    assert hardware.dtype == emulated.dtype == out_dtype
    assert hardware.shape == emulated.shape == (m, n)
    gemm_ref = _reference(a, b)
    ref = gemm_ref + (0 if bias is None else bias.double().reshape(1, -1))
    # The hardware path's arguments are right: one rounding of the exact result.
    _assert_matches(hardware, ref, out_dtype)
    hardware, emulated = hardware.double(), emulated.double()
    slack = MAX_REL_ERR_F32 * gemm_ref.abs().max()
    if out_dtype == torch.float32:
        assert (hardware - emulated).abs().max() <= 2 * slack
    else:
        # One ulp, at the magnitude of the GEMM or of the output, whichever is larger.
        magnitude = torch.maximum(torch.maximum(hardware.abs(), emulated.abs()), gemm_ref.abs())
        assert ((hardware - emulated).abs() <= _bf16_ulp(magnitude) + slack).all()


def test_hardware_scales_tensorwise_and_rowwise():
    m, n, k = HARDWARE_SHAPE
    a, b = quantize(_random((m, k), 61), "tensor"), quantize(_random((n, k), 62), "tensor")
    scale_a, scale_b = gemm_module.hardware_scales(a, b)
    assert scale_a.shape == scale_b.shape == () and scale_a.dtype == torch.float32
    assert scale_a.item() == a.scale_inv.item() and scale_b.item() == b.scale_inv.item()

    a, b = quantize(_random((m, k), 61), "row"), quantize(_random((n, k), 62), "row")
    scale_a, scale_b = gemm_module.hardware_scales(a, b)
    assert scale_a.shape == (m, 1) and scale_b.shape == (1, n)
    assert scale_a.is_contiguous() and scale_b.is_contiguous()
    assert torch.equal(scale_a, a.scale_inv.reshape(m, 1)) and torch.equal(scale_b, b.scale_inv.reshape(1, n))

    with pytest.raises(NotImplementedError, match="tensorwise x tensorwise or rowwise x rowwise"):
        gemm_module.hardware_scales(quantize(_random((m, k), 61), "row"), quantize(_random((n, k), 62), "tensor"))


def _pad4(value: int) -> int:
    return -(-value // 4) * 4


# (M, N, K): K/128 = 3 (pads to 4), and K/128 = 5.
BLOCK_LAYOUT_SHAPES = [(256, 128, 384), (128, 384, 640)]


@pytest.mark.parametrize("m, n, k", BLOCK_LAYOUT_SHAPES)
@pytest.mark.parametrize(
    "a_gran, b_gran",
    [("block1x128", "block128x128"), ("block1x128", "block1x128"), ("block128x128", "block1x128")],
)
def test_hardware_scales_blockwise_layout(a_gran, b_gran, m, n, k):
    a, b = quantize(_random((m, k), 71), a_gran), quantize(_random((n, k), 72), b_gran)
    scale_a, scale_b = gemm_module.hardware_scales(a, b)
    kb = k // 128
    if a_gran == "block1x128":  # (M, K/128), outer-dim (M) fastest, padded to 4
        assert scale_a.shape == (m, kb) and scale_a.stride() == (1, _pad4(m))
    else:  # (M/128, K/128), row-major with the K tiles padded to 4
        assert scale_a.shape == (m // 128, kb) and scale_a.stride() == (_pad4(kb), 1)
    assert torch.equal(scale_a, a.scale_inv)
    if b_gran == "block1x128":  # (K/128, N), N fastest, padded to 4
        assert scale_b.shape == (kb, n) and scale_b.stride() == (_pad4(n), 1)
    else:  # (K/128, N/128) as the transpose of [N/128, pad4(K/128)]
        assert scale_b.shape == (kb, n // 128) and scale_b.stride() == (1, _pad4(kb))
    assert torch.equal(scale_b, b.scale_inv.t())
    for scale in (scale_a, scale_b):
        assert scale.dtype == torch.float32


def _swizzled_position(row: int, col: int, padded_cols: int) -> int:
    """Flat index of scale (row, col) in the 128x4-tile layout of NUMERICS.md section 3."""
    tile = (row // 128) * (padded_cols // 4) + col // 4
    in_tile_row = row % 128
    return tile * 512 + (in_tile_row % 32) * 16 + (in_tile_row // 32) * 4 + col % 4


@pytest.mark.parametrize("m, n, k", [(160, 96, 416), (256, 32, 128)])
def test_hardware_scales_mx_swizzled(m, n, k):
    a, b = quantize(_random((m, k), 81), "mx"), quantize(_random((n, k), 82), "mx")
    scale_a, scale_b = gemm_module.hardware_scales(a, b)
    for qt, scale, rows in ((a, scale_a, m), (b, scale_b, n)):
        padded_rows, padded_cols = -(-rows // 128) * 128, _pad4(k // 32)
        assert scale.dtype == torch.float8_e8m0fnu and scale.dim() == 1
        assert scale.numel() == padded_rows * padded_cols
        codes = scale.view(torch.uint8)
        compact = qt.scale_inv.view(torch.uint8)
        expected = torch.zeros(padded_rows * padded_cols, dtype=torch.uint8)
        for r in range(rows):
            for c in range(k // 32):
                expected[_swizzled_position(r, c, padded_cols)] = compact[r, c]
        assert torch.equal(codes, expected)
        assert torch.equal(scale, swizzle_mx_scales(qt.scale_inv).reshape(-1))


# ---------------------------------------------------------------- backends and errors


@pytest.mark.parametrize("a_gran, b_gran", [("tensor", "tensor"), ("row", "row"), ("block1x128", "block128x128"), ("mx", "mx")])
def test_hardware_backend_on_cpu_raises_with_the_way_out(a_gran, b_gran):
    a, b = _pair(a_gran, b_gran)
    with pytest.raises(RuntimeError, match=r"no FP8 GEMM on this device.*emulated"):
        scaled_mm(a, b, backend="hardware")


def test_auto_backend_on_cpu_runs_emulated_and_logs_once(caplog):
    gemm_module._log_backend_once.cache_clear()
    a, b = _pair("row", "row")
    with caplog.at_level(logging.INFO, logger="fp8train.gemm"):
        auto = scaled_mm(a, b, torch.float32, backend="auto")
        scaled_mm(a, b, torch.float32)  # default backend is auto
    records = [r for r in caplog.records if r.name == "fp8train.gemm"]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert "emulated" in message and "cpu" in message
    assert torch.equal(auto, scaled_mm(a, b, torch.float32, backend="emulated"))


def test_emulated_backend_does_not_log(caplog):
    gemm_module._log_backend_once.cache_clear()
    a, b = _pair("tensor", "tensor")
    with caplog.at_level(logging.INFO, logger="fp8train.gemm"):
        scaled_mm(a, b, torch.float32, backend="emulated")
    assert not [r for r in caplog.records if r.name == "fp8train.gemm"]


def test_bad_arguments_raise_value_error():
    a, b = _pair("tensor", "tensor")
    with pytest.raises(ValueError, match="backend='cuda' must be one of auto, emulated, hardware"):
        scaled_mm(a, b, backend="cuda")
    for out_dtype in (torch.float64, torch.int32, E4M3):
        with pytest.raises(ValueError, match="out_dtype=.* must be float32, bfloat16 or float16"):
            scaled_mm(a, b, out_dtype)
    short_k = quantize(_random((64, 96), 1), "tensor")
    with pytest.raises(ValueError, match=r"contraction dims differ: a is \(200, 328\), b is \(64, 96\)"):
        scaled_mm(a, short_k)
    three_d = quantize(_random((64, 328), 1).reshape(2, 32, 328), "tensor")
    with pytest.raises(ValueError, match=r"a must be 2-D, got shape \(2, 32, 328\)"):
        scaled_mm(three_d, b)


@pytest.mark.parametrize("granularity", ["row", "block1x128", "mx"])
def test_axis0_operand_without_transpose_raises(granularity):
    m, n, k = 256, 128, 256
    a = quantize(_random((m, k), 1), granularity)
    b_axis0 = quantize(_random((n, k), 2), granularity, axis=0)
    with pytest.raises(ValueError, match=rf"b \({granularity}\) is scaled along its first dim \(axis=0\).*transpose\(b\)"):
        scaled_mm(a, b_axis0)
    with pytest.raises(ValueError, match=r"a .* \(axis=0\)"):
        scaled_mm(b_axis0, a)


@pytest.mark.parametrize(
    "a_gran, b_gran", [("row", "block1x128"), ("tensor", "mx"), ("mx", "block1x128"), ("block128x128", "tensor")]
)
@pytest.mark.parametrize("backend", ["emulated", "auto", "hardware"])
def test_mixing_recipe_families_is_not_implemented(a_gran, b_gran, backend):
    a = quantize(_random((128, 256), 1), a_gran)
    b = quantize(_random((128, 256), 2), b_gran)
    with pytest.raises(NotImplementedError, match=rf"no FP8 GEMM mixes '{a_gran}' with '{b_gran}'"):
        scaled_mm(a, b, backend=backend)


# ---------------------------------------------------------------- fp8_to_hp

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


def test_scaled_mm_is_public():
    assert fp8train.scaled_mm is scaled_mm


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
