"""An FP8 moment: E4M3 codes with one float32 scale per block of the flattened tensor.

The tensor is flattened, zero-padded to a multiple of the block size and viewed as
``(num_blocks, block_size)``; each row is one block and is quantized by fp8train's own
per-row rule (``QuantRule(granularity="row", power_2_scales=False)``): ``scale = 448 / amax``
of the block, ``codes = cast_to_fp8(x * scale)`` (round to nearest even, saturating), and
``x ~= codes * scale_inv``. The scale is not rounded to a power of two, so every block's
largest value lands on E4M3's largest, 448, and keeps the format's full range below it.

Why per block rather than per tensor: E4M3 spans about 2**17 (448 down to its smallest
subnormal, 2**-9) with 3 mantissa bits. A weight matrix's moment varies by more than that
across its rows and columns (a rarely active input, a dead unit), and one scale for the
whole tensor rounds those entries to zero or to one or two significant bits; AdamW's update
``m / (sqrt(v) + eps)`` is about 1 wherever ``m`` and ``v`` are both small, so those weights
would stop moving. A block of 128 neighbours shares its magnitude far more closely.
``tests/optim/test_fp8_moment.py`` and ``benchmarks/optim_master_rounding.py`` measure the
two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..quant.quantize import quantize
from ..quant.tensor import QuantizedTensor
from ..spec.rule import QuantRule

__all__ = ["BLOCK_RULE", "quantize_blocks", "dequantize_blocks", "zero_blocks"]

BLOCK_RULE = QuantRule(granularity="row", power_2_scales=False)
"""E4M3, one float32 scale per row of the ``(num_blocks, block_size)`` view, ``448 / amax``."""


def quantize_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 ``x`` (any shape) to E4M3 with one scale per ``block_size``
    consecutive elements of ``x.reshape(-1)``.

    Returns:
        ``(codes, scale_inv)``: ``float8_e4m3fn`` of shape ``(num_blocks, block_size)``
        (the tail zero-padded) and float32 of shape ``(num_blocks, 1)``,
        ``num_blocks = ceil(x.numel() / block_size)``.
    """
    flat = x.reshape(-1)
    num_blocks = math.ceil(flat.numel() / block_size)
    padding = num_blocks * block_size - flat.numel()
    if padding:
        flat = F.pad(flat, (0, padding))
    if num_blocks == 0:
        empty = torch.empty(0, block_size, dtype=torch.float8_e4m3fn, device=x.device)
        return empty, torch.empty(0, 1, dtype=torch.float32, device=x.device)
    quantized = quantize(flat.view(num_blocks, block_size), BLOCK_RULE, axis=-1)
    return quantized.data, quantized.scale_inv


def dequantize_blocks(codes: torch.Tensor, scale_inv: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The float32 tensor of ``shape`` that :func:`quantize_blocks` stored as ``(codes, scale_inv)``."""
    numel = math.prod(shape)
    if codes.numel() == 0:
        return torch.zeros(shape, dtype=torch.float32, device=codes.device)
    quantized = QuantizedTensor(codes, scale_inv, BLOCK_RULE.granularity, axis=-1, power_2_scales=False)
    return quantized.dequantize(torch.float32).reshape(-1)[:numel].view(shape)


def zero_blocks(numel: int, block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`quantize_blocks` gives for ``numel`` zeros, without the float32 zeros:
    one zero block quantized, its scale repeated."""
    _, zero_scale_inv = quantize_blocks(torch.zeros(block_size, device=device), block_size)
    num_blocks = math.ceil(numel / block_size)
    codes = torch.zeros(num_blocks, block_size, dtype=torch.float8_e4m3fn, device=device)
    return codes, zero_scale_inv.expand(num_blocks, 1).clone()
