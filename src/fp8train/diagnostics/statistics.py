"""What quantization did to a tensor: SQNR, underflow, saturation, amax, scales.

Every statistic compares a high-precision tensor ``x`` with its quantization ``q``
(:class:`~fp8train.quant.tensor.QuantizedTensor`, same orientation) over the *finite*
values of ``x``; non-finite values are counted, not compared:

* ``sqnr_db``: ``10 log10(sum x^2 / sum (x - dequant(q))^2)`` in float64; ``inf`` when the
  quantization is exact (an all-zero tensor included);
* ``underflow_pct``: % of the non-zero values of ``x`` whose code is zero (E2M1: whose
  scaled magnitude ``|x * scale|`` is at most 0.25, half the smallest non-zero value 0.5);
* ``saturation_pct``: % of the values of ``x`` that the saturating cast clipped: their
  scaled magnitude ``|x * scale|`` lies above the format's max by more than half a unit
  in the last place there, so rounding alone would not have brought them back to the max
  (a value that lands on the max exactly, as a tensor's amax does under current scaling,
  is not clipped). E2M1: above 7 (max 6, ulp 2 there); NVFP4's and MXFP4's scales put a
  group's amax at or below 6.375, so they do not clip;
* ``amax``: the largest finite ``|x|``; ``nonfinite``: the count of NaN and ±inf in ``x``;
* ``scale_min``, ``scale_max``: the range of the scales used (``scale = 1 / scale_inv``;
  NVFP4: ``1 / (scale_inv * gd)``, the block scale under the global one: what takes ``x``
  to its code) by the scaling groups that hold a non-zero code (an all-zero group, such as
  the zero padding of a token dim, gets an arbitrary scale).

4-bit data (``torch.float4_e2m1fn_x2``, two codes a byte) is unpacked first: every
statistic is over the values, in the shape :meth:`QuantizedTensor.dequantize` gives.
"""

from __future__ import annotations

import math

import torch

from ..spec.formats import E2M1, FloatFormat
from ..spec.granularities import view_2d_shape
from ..quant.cast import format_of
from ..quant.e2m1 import E2M1_VALUES, unpack_e2m1
from ..quant.scaling import nvfp4_global_scales
from ..quant.tensor import QuantizedTensor

__all__ = ["sqnr_db", "quantization_statistics", "clip_ratio", "finite_mask", "count_nonfinite"]


def finite_mask(x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor | None:
    """``isfinite(x)``, or ``None`` when every value is finite (the common case, checked by
    one reduction: ``amax`` propagates NaN, and an inf shows in it; pass ``|x|.amax()``
    where it is known)."""
    if x.numel() == 0:
        return None
    if amax is None:
        amax = x.abs().amax()
    return None if bool(torch.isfinite(amax)) else torch.isfinite(x)


def count_nonfinite(x: torch.Tensor) -> int:
    """The number of NaN and ±inf values in ``x``."""
    finite = finite_mask(x)
    return 0 if finite is None else x.numel() - int(finite.sum())


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor, *, reference_amax: torch.Tensor | None = None) -> float:
    """Signal-to-quantization-noise ratio in dB of ``approximation`` against ``reference``,
    over the finite values of ``reference``. ``inf`` when they agree exactly; ``-inf`` when
    the reference is all zero and the approximation is not; ``nan`` when the approximation
    is non-finite where the reference is finite.

    The difference is taken in the reference's dtype (float32 for 16-bit inputs) and the
    sums of squares as dot products, so the result is within ~0.001 dB of a float64
    computation, at a fraction of its cost. ``reference_amax``: ``|reference|.amax()``,
    where the caller has it.
    """
    dtype = reference.dtype if reference.dtype in (torch.float32, torch.float64) else torch.float32
    reference, approximation = reference.to(dtype), approximation.to(dtype)
    finite = finite_mask(reference, reference_amax)
    if finite is not None:
        reference, approximation = reference[finite], approximation[finite]
    reference = reference.reshape(-1)
    difference = (reference - approximation.reshape(-1))
    noise = float(torch.dot(difference, difference))
    signal = float(torch.dot(reference, reference))
    if math.isnan(noise) or math.isinf(noise):
        return math.nan
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def clip_ratio(fp8_max: float, mantissa_bits: int) -> float:
    """``(max + ulp(max) / 2) / max``: a value whose scaled magnitude exceeds the format's
    max by this factor was clipped by the saturating cast (464/448 for E4M3, 61440/57344
    for E5M2)."""
    half_ulp = 2.0 ** (math.floor(math.log2(fp8_max)) - mantissa_bits) / 2
    return (fp8_max + half_ulp) / fp8_max


def _data_format(qt: QuantizedTensor) -> FloatFormat:
    return E2M1 if qt.granularity.fp4 else format_of(qt.data.dtype)


def _max_magnitude_code(fmt: FloatFormat, dtype: torch.dtype) -> int:
    """The magnitude bits of ``fmt``'s largest finite value (E2M1: 7, the code of 6)."""
    if fmt is E2M1:
        return len(E2M1_VALUES) - 1
    return int(torch.tensor(fmt.max).to(dtype).view(torch.uint8))


def _magnitude_codes(qt: QuantizedTensor) -> torch.Tensor:
    """The magnitude bits (uint8) of every code of ``qt``, 0 for a flushed value: FP8 in
    :attr:`~QuantizedTensor.data`'s shape; 4-bit unpacked, in the 2-D view
    :attr:`~QuantizedTensor.unpacked_shape_2d`."""
    if not qt.granularity.fp4:
        return qt.data.view(torch.uint8) & 0x7F
    packed = qt.data.reshape(view_2d_shape(qt.data.shape))
    return unpack_e2m1(packed, qt.axis) & (len(E2M1_VALUES) - 1)


def _scales_of_used_groups(qt: QuantizedTensor, magnitude_codes: torch.Tensor) -> torch.Tensor:
    """float64 scales of the groups of ``qt`` holding a non-zero code (all groups if none
    do); NVFP4's under its global decode scale."""
    scale_inv = qt.scale_inv_float32().to(torch.float64)
    if qt.global_amax is not None:
        scale_inv = scale_inv * nvfp4_global_scales(qt.global_amax)[1].to(torch.float64)
    scales = 1.0 / scale_inv
    if scales.numel() <= 1:
        return scales.reshape(-1)
    m, k = qt.unpacked_shape_2d
    rows, cols = qt.group_shape
    used = magnitude_codes.reshape(m // rows, rows, k // cols, cols).amax(dim=(1, 3)).reshape(-1) > 0
    scales = scales.reshape(-1)
    return scales[used] if bool(used.any()) else scales


def quantization_statistics(x_hp: torch.Tensor, qt: QuantizedTensor) -> dict:
    """The statistics of the module docstring for ``x_hp`` and its quantization ``qt``.

    Args:
        x_hp: the high-precision tensor, in ``qt``'s orientation (transpose it first for a
            first-dim usage that came back transposed), and in the domain its codes hold
            (for a rule with the Hadamard transform, the transformed tensor). ``qt`` may be
            larger, zero-padded along either dim (as a layer pads its token dim); the part
            matching ``x_hp``'s shape is compared.
        qt: its quantization (FP8 or 4-bit; 4-bit along ``axis=0`` compares the 2-D view).

    Returns:
        ``{"sqnr_db", "underflow_pct", "saturation_pct", "amax", "nonfinite", "scale_min",
        "scale_max"}``; percentages are ``0.0`` for an empty or all-zero tensor.

    Raises:
        ValueError: ``qt`` is smaller than ``x_hp`` in some dim.
    """
    x_dq = qt.dequantize(torch.float32)
    if x_dq.dim() != x_hp.dim() or any(q < x for q, x in zip(x_dq.shape, x_hp.shape)):
        raise ValueError(
            f"the quantized tensor of shape {tuple(x_dq.shape)} (its values) does not cover x_hp of shape "
            f"{tuple(x_hp.shape)}; pass x_hp in the quantized tensor's orientation"
        )
    crop = tuple(slice(0, size) for size in x_hp.shape)
    fmt = _data_format(qt)
    # Magnitude bits of the codes: 0 is a flushed value, max_code the format's max.
    all_codes = _magnitude_codes(qt)
    magnitude_codes = all_codes.reshape(x_dq.shape)[crop]
    max_code = _max_magnitude_code(fmt, qt.data.dtype)
    x_dq = x_dq[crop]
    x = x_hp.to(torch.float32)
    amax = x.abs().amax() if x.numel() else torch.zeros(())
    finite = finite_mask(x, amax)
    num_finite = x.numel() if finite is None else int(finite.sum())
    x_finite = x if finite is None else torch.where(finite, x, torch.zeros_like(x))
    if finite is not None:
        amax = x_finite.abs().amax()
    # A zero quantizes to a zero code and a finite value to a finite code, so the flushed
    # values are the non-zero ones less the non-zero codes (NaN/inf codes left out).
    num_nonzero = int(torch.count_nonzero(x_finite))
    nonzero_codes = magnitude_codes if finite is None else torch.where(finite, magnitude_codes, 0)
    underflowed = num_nonzero - int(torch.count_nonzero(nonzero_codes))
    # Clipped: the code is the max and |x| lies beyond what rounding maps onto it.
    at_max = magnitude_codes == max_code
    clipped = int((x_finite[at_max].abs() > x_dq[at_max].abs() * clip_ratio(fmt.max, fmt.mantissa_bits)).sum())
    scales = _scales_of_used_groups(qt, all_codes)
    return {
        "sqnr_db": sqnr_db(x, x_dq, reference_amax=amax),
        "underflow_pct": 100.0 * underflowed / num_nonzero if num_nonzero else 0.0,
        "saturation_pct": 100.0 * clipped / num_finite if num_finite else 0.0,
        "amax": float(amax),
        "nonfinite": x.numel() - num_finite,
        "scale_min": float(scales.min()) if scales.numel() else math.nan,
        "scale_max": float(scales.max()) if scales.numel() else math.nan,
    }
