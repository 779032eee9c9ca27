"""An independent numpy/ml_dtypes reference for ``quantize`` (NUMERICS.md sections 2-3) and
helpers shared by the quantize tests (test_quantize*.py)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from fp8train.quant.tensor import QuantizedTensor
from fp8train.spec.granularities import FP8_GRANULARITIES as GRANULARITIES

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")
BFLOAT16_MAX = float.fromhex("0x1.fep+127")

# Per FP8 data dtype: ml_dtypes type, largest finite, mantissa bits, smallest normal.
FP8_FACTS = {
    E4M3: (ml_dtypes.float8_e4m3fn, 448.0, 3, 2.0**-6),
    E5M2: (ml_dtypes.float8_e5m2, 57344.0, 2, 2.0**-14),
}
BLOCK_SIZE = {"block1x128": 128, "block128x128": 128, "mx": 32}
AXES = (-1, 0)
ALL_CASES = [(g, a) for g in GRANULARITIES for a in AXES]


def _group_shape(granularity: str, axis: int, m: int, k: int) -> tuple[int, int]:
    """``(rows, cols)`` of one scaling group: the table in NUMERICS.md / quantize.py."""
    if granularity == "tensor":
        return m, k
    if granularity == "row":
        return (1, k) if axis == -1 else (m, 1)
    if granularity == "block128x128":
        return 128, 128
    block = BLOCK_SIZE[granularity]
    return (1, block) if axis == -1 else (block, 1)


def _scale_inv_shape(granularity: str, axis: int, m: int, k: int) -> tuple[int, ...]:
    if granularity == "tensor":
        return ()
    rows, cols = _group_shape(granularity, axis, m, k)
    return (m // rows if rows else 1, k // cols if cols else 1)


def _oracle_cast(x_f32: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Saturating RNE cast by ml_dtypes, as uint8 codes."""
    ml_type, fp8_max, _, _ = FP8_FACTS[dtype]
    with np.errstate(invalid="ignore"):
        return np.clip(x_f32, -fp8_max, fp8_max).astype(ml_type).view(np.uint8)


def _fp8_values(codes: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return codes.view(FP8_FACTS[dtype][0]).astype(np.float64)


def _decode_e8m0(codes: np.ndarray) -> np.ndarray:
    values = np.ldexp(1.0, codes.astype(np.int64) - 127)
    return np.where(codes == 0xFF, np.nan, values)


def _reference_mx_exponent(amax: np.ndarray, fp8_max: float, rule: str) -> np.ndarray:
    """Biased E8M0 exponent per block, from the closed forms in NUMERICS.md."""
    reciprocal = float(np.float32(1.0 / fp8_max))  # the spec multiplies by float32(1/448)
    emax = math.frexp(fp8_max)[1] - 1
    out = np.zeros(amax.shape, dtype=np.int64)
    for index, a in np.ndenumerate(amax.astype(np.float64)):
        if math.isnan(a):
            e = 0xFF
        elif math.isinf(a):
            e = 0xFE
        elif a == 0:
            e = 0
        elif rule == "ceil":
            # smallest j with a <= fp8_max * 2^j (exact comparisons in float64)
            j = math.ceil(math.log2(a / fp8_max))
            while a > fp8_max * 2.0**j:
                j += 1
            while a <= fp8_max * 2.0 ** (j - 1):
                j -= 1
            e = j + 127
            if e <= 1:
                # t = float32(a * float32(1/fp8_max)) is 2^-126 or a float32 subnormal, whose
                # rounding is coarser than a's spacing: compute it as the library does. The
                # smallest power of two >= t is 2^-127 (code 0) up to t = 2^-127, else 2^-126.
                t = float(np.float32(a) * np.float32(reciprocal))
                e = 0 if t <= 2.0**-127 else 1
        else:
            e = min(max(math.frexp(a)[1] - 1 - emax + 127, 0), 254)
        out[index] = e
    return out


def _reference_quantize(
    x_hp: torch.Tensor,
    granularity: str,
    axis: int,
    dtype: torch.dtype,
    power_2_scales: bool,
    mx_scale_rule: str = "ceil",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Data codes ``(M, K)``, compact scale_inv (float32, or uint8 E8M0 codes) and the float32
    scale per group (shaped ``(M/rows, 1, K/cols, 1)``), in numpy."""
    _, fp8_max, _, _ = FP8_FACTS[dtype]
    x = x_hp.to(torch.float32).numpy()  # exact from bf16/fp16
    m, k = (math.prod(x.shape[:-1]), x.shape[-1])
    rows, cols = _group_shape(granularity, axis, m, k)
    groups = x.reshape(m // rows, rows, k // cols, cols)
    amax = np.abs(groups).max(axis=(1, 3), keepdims=True)
    if granularity == "mx":
        exponent = _reference_mx_exponent(amax, fp8_max, mx_scale_rule)
        scale = np.ldexp(1.0, 127 - exponent).astype(np.float32)
        scale = np.where(exponent == 0xFF, np.float32(np.nan), scale)
        scale_inv = exponent.astype(np.uint8)
    else:
        inf_scale_value = torch.finfo(x_hp.dtype).max if granularity in BLOCK_SIZE else FLOAT32_MAX
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            scale = np.float32(fp8_max) / amax
        scale = np.where(np.isinf(scale), np.float32(inf_scale_value), scale)
        scale = np.where((amax == 0) | ~np.isfinite(amax), np.float32(1), scale).astype(np.float32)
        if power_2_scales:
            scale = np.ldexp(1.0, np.frexp(scale)[1] - 1).astype(np.float32)
        scale_inv = (np.float32(1) / scale).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        data = _oracle_cast((groups * scale).astype(np.float32), dtype).reshape(m, k)
    return data, scale_inv.reshape(scale_inv.shape[0], scale_inv.shape[2]), scale


def _codes(qt: QuantizedTensor) -> np.ndarray:
    return qt.data.reshape(-1, qt.data.shape[-1] if qt.data.dim() else 1).view(torch.uint8).numpy()


def _assert_data_equal(actual_codes: np.ndarray, expected_codes: np.ndarray, dtype: torch.dtype) -> None:
    # NaN codes differ between torch and ml_dtypes: NaN positions only need to be NaN.
    actual_nan = np.isnan(_fp8_values(actual_codes, dtype))
    expected_nan = np.isnan(_fp8_values(expected_codes, dtype))
    np.testing.assert_array_equal(actual_nan, expected_nan)
    np.testing.assert_array_equal(actual_codes[~expected_nan], expected_codes[~expected_nan])


def _bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor of any rank (0-d included), for bit-exact comparisons."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _scale_inv_f64(qt: QuantizedTensor) -> np.ndarray:
    if qt.granularity == "mx":
        return _decode_e8m0(qt.scale_inv.view(torch.uint8).numpy())
    return qt.scale_inv.numpy().astype(np.float64)


def _random_normal(shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)
