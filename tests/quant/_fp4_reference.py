"""An independent NumPy reference for 4-bit quantization, written from NUMERICS.md section 6
(not from fp8train's code): the E2M1 cast by nearest distance with ties to the even code,
NVFP4's two-level scale, MXFP4's E8M0 rule, the packing. NumPy float32 arithmetic rounds
each operation to nearest, as the contract's "all arithmetic float32" says."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_codes(v: np.ndarray) -> np.ndarray:
    """Codes (uint8) of float32 ``v`` in [-6, 6]: nearest grid value, a tie to the even code;
    ``v < 0`` sets bit 3 (also when it rounds to 0); NaN and -0.0 give 0."""
    magnitude = np.abs(v.astype(np.float64))
    distance = np.abs(magnitude[..., None] - E2M1_GRID)
    nearest = distance == distance.min(axis=-1, keepdims=True)  # all False for NaN: index 0
    even = nearest & (np.arange(8) % 2 == 0)
    index = np.where(nearest.sum(-1) > 1, np.argmax(even, -1), np.argmax(nearest, -1))
    with np.errstate(invalid="ignore"):
        code = index + np.where(v < 0, 8, 0)
    return np.where(np.isnan(v), 0, code).astype(np.uint8)


def pack(codes: np.ndarray, axis: int) -> np.ndarray:
    """Byte j of a pair along ``axis``: code 2j in the low nibble, 2j + 1 in the high one."""
    codes = np.moveaxis(codes, axis, -1)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.moveaxis(packed, -1, axis)


def _groups(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    m, k = x.shape
    return x.reshape(m // rows, rows, k // cols, cols)


def _group_amax(groups: np.ndarray) -> np.ndarray:
    return np.abs(groups).max(axis=(1, 3), keepdims=True)  # NaN propagates


def nvfp4(x: np.ndarray, rows: int, cols: int):
    """``(codes [M, K], dec as E4M3 bits [M/rows, K/cols], global_amax)`` of float32 2-D ``x``."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        global_amax = F32(np.abs(x).max())
        ge = np.minimum(F32(2688.0) / global_amax, FLT_MAX)
        if ge == 0:
            ge = F32(1.0)
        gd = F32(1.0) / ge
        m = F32(ge * F32(1.0 / 6.0))
        groups = _groups(x, rows, cols)
        dec = np.clip(np.minimum(_group_amax(groups) * m, FLT_MAX), F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn)
        enc = np.minimum(F32(1.0) / (dec.astype(F32) * gd), FLT_MAX)
        scaled = np.clip(groups * enc, F32(-6), F32(6))
    codes = e2m1_codes(scaled).reshape(x.shape)
    return codes, dec.view(np.uint8)[:, 0, :, 0], global_amax


def _e8m0_exponent(t: np.ndarray) -> np.ndarray:
    """The MXFP8 rule: t's biased exponent, rounded up; subnormal, NaN, inf, zero cases."""
    bits = t.view(np.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = np.where(exponent == 0, mantissa > 0x400000, mantissa != 0)
    e = exponent + up
    e = np.where(t == 0, 0, e)
    e = np.where(np.isinf(t), 0xFE, e)
    return np.where(np.isnan(t), 0xFF, e)


def mxfp4(x: np.ndarray, rows: int, cols: int):
    """``(codes [M, K], E8M0 bits [M/rows, K/cols])`` of float32 2-D ``x``."""
    groups = _groups(x, rows, cols)
    with np.errstate(over="ignore", invalid="ignore"):
        t = (_group_amax(groups) * F32(1.0 / 6.0)).astype(F32)
        e = _e8m0_exponent(t)
        scale = np.ldexp(F32(1.0), (127 - e).astype(np.int32)).astype(F32)
        scale = np.where(e == 0xFF, F32(np.nan), scale)
        scaled = np.clip(groups * scale, F32(-6), F32(6))
    return e2m1_codes(scaled).reshape(x.shape), e[:, 0, :, 0].astype(np.uint8)


def to_numpy_f32(x: torch.Tensor) -> np.ndarray:
    """The values of ``x`` (any float dtype) as float32 (exact), 2-D view."""
    x = x.reshape(-1, x.shape[-1])
    return x.to(torch.float32).numpy().copy()
