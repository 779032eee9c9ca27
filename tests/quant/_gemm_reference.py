"""Reference GEMMs for ``scaled_mm`` (float64 GEMMs of the dequantized operands, the
literal per-chunk promotion), shapes, operand pairings and the error bound, shared by
test_gemm_emulated.py and test_gemm_hardware.py."""

from __future__ import annotations

import pytest
import torch

from fp8train.quant import quantize
from fp8train.quant.tensor import QuantizedTensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

# float32 out: error relative to max|ref| (float32 accumulation of K exact products).
MAX_REL_ERR_F32 = 1e-6
# One rounding to the output dtype, relative to |ref| (unit roundoff 2^-p).
OUT_ROUNDING = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# (M, N, K) per recipe family: not multiples of 512; block dims multiples of 128, MX of 32
# (K/32 = 13 so the swizzle pads its columns), tensor/row dims anything.
SHAPES = {"tensor": (200, 136, 328), "row": (200, 136, 328), "block": (256, 128, 384), "mx": (160, 96, 416)}

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
