"""What quantization did to a tensor: SQNR, underflow, saturation, amax, scales.

Every statistic compares a high-precision tensor ``x`` with its quantization ``q``
(:class:`~fp8train.quant.tensor.QuantizedTensor`, same orientation) over the *finite*
values of ``x``; non-finite values are counted, not compared:

* ``sqnr_db``: ``10 log10(sum x^2 / sum (x - dequant(q))^2)`` in float64; ``inf`` when the
  quantization is exact (an all-zero tensor included);
* ``underflow_pct``: % of the non-zero values of ``x`` whose FP8 code is zero;
* ``saturation_pct``: % of the values of ``x`` that the saturating cast clipped: their
  scaled magnitude ``|x * scale|`` lies above the format's max by more than half a unit
  in the last place there, so rounding alone would not have brought them back to the max
  (a value that lands on the max exactly, as a tensor's amax does under current scaling,
  is not clipped);
* ``amax``: the largest finite ``|x|``; ``nonfinite``: the count of NaN and ±inf in ``x``;
* ``scale_min``, ``scale_max``: the range of the scales used (``scale = 1 / scale_inv``)
  by the scaling groups that hold a non-zero code (an all-zero group, such as the zero
  padding of a token dim, gets an arbitrary scale).
"""

from __future__ import annotations

import math

import torch

from .cast import format_of
from .tensor import QuantizedTensor, view_2d_shape

__all__ = ["sqnr_db", "quantization_statistics", "clip_ratio"]


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of ``approximation`` against ``reference``,
    over the finite values of ``reference`` (float64). ``inf`` when they agree exactly;
    ``-inf`` when the reference is all zero and the approximation is not; ``nan`` when the
    approximation is non-finite where the reference is finite."""
    reference = reference.to(torch.float64)
    approximation = approximation.to(torch.float64)
    finite = torch.isfinite(reference)
    if not bool(finite.all()):
        reference, approximation = reference[finite], approximation[finite]
    noise = float((reference - approximation).pow(2).sum())
    signal = float(reference.pow(2).sum())
    if math.isnan(noise):
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


def _scales_of_used_groups(qt: QuantizedTensor) -> torch.Tensor:
    """float64 scales of the groups of ``qt`` holding a non-zero code (all groups if none do)."""
    scales = 1.0 / qt.scale_inv_float32().to(torch.float64)
    if scales.numel() <= 1:
        return scales.reshape(-1)
    m, k = view_2d_shape(qt.data.shape)
    rows, cols = qt.group_shape
    codes = qt.data.reshape(m // rows, rows, k // cols, cols).to(torch.float32).abs()
    used = codes.amax(dim=(1, 3)).reshape(-1) > 0
    scales = scales.reshape(-1)
    return scales[used] if bool(used.any()) else scales


def quantization_statistics(x_hp: torch.Tensor, qt: QuantizedTensor) -> dict:
    """The statistics of the module docstring for ``x_hp`` and its quantization ``qt``.

    Args:
        x_hp: the high-precision tensor, in ``qt``'s orientation (transpose it first for a
            first-dim usage that came back transposed). ``qt`` may be larger, zero-padded
            along either dim (as a layer pads its token dim); the part matching ``x_hp``'s
            shape is compared.
        qt: its quantization.

    Returns:
        ``{"sqnr_db", "underflow_pct", "saturation_pct", "amax", "nonfinite", "scale_min",
        "scale_max"}``; percentages are ``0.0`` for an empty or all-zero tensor.

    Raises:
        ValueError: ``qt`` is smaller than ``x_hp`` in some dim.
    """
    if qt.data.dim() != x_hp.dim() or any(q < x for q, x in zip(qt.data.shape, x_hp.shape)):
        raise ValueError(
            f"the quantized tensor of shape {tuple(qt.data.shape)} does not cover x_hp of shape "
            f"{tuple(x_hp.shape)}; pass x_hp in the quantized tensor's orientation"
        )
    crop = tuple(slice(0, size) for size in x_hp.shape)
    codes = qt.data[crop].to(torch.float32)
    x_dq = qt.dequantize(torch.float32)[crop]
    x = x_hp.to(torch.float32)
    finite = torch.isfinite(x)
    magnitude = torch.where(finite, x.abs(), torch.zeros_like(x))
    nonzero = finite & (x != 0)
    num_nonzero = int(nonzero.sum())
    fmt = format_of(qt.data.dtype)
    # Clipped: the code is the max and |x| lies beyond what rounding maps onto it.
    at_max = codes.abs() == fmt.max
    clipped = at_max & (magnitude > x_dq.abs() * clip_ratio(fmt.max, fmt.mantissa_bits))
    num_finite = int(finite.sum())
    scales = _scales_of_used_groups(qt)
    return {
        "sqnr_db": sqnr_db(x, x_dq),
        "underflow_pct": 100.0 * int((nonzero & (codes == 0)).sum()) / num_nonzero if num_nonzero else 0.0,
        "saturation_pct": 100.0 * int(clipped.sum()) / num_finite if num_finite else 0.0,
        "amax": float(magnitude.max()) if x.numel() else 0.0,
        "nonfinite": x.numel() - num_finite,
        "scale_min": float(scales.min()) if scales.numel() else math.nan,
        "scale_max": float(scales.max()) if scales.numel() else math.nan,
    }
