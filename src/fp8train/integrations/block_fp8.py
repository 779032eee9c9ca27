"""A weight as the block-scaled E4M3 of DeepSeek-V3 and Qwen3-FP8 checkpoints: one float32
``weight_scale_inv`` per 128x128 block, blocks at the ragged edges included; or, as
DeepSeek-V3.1 and later write it (``"scale_fmt": "ue8m0"``), with every block's
``weight_scale_inv`` a power of two (:data:`UE8M0_WEIGHT_BLOCK_RULE`).

``weight ~= weight_fp8 * weight_scale_inv`` per block, where (fp8train's one scale rule,
:mod:`fp8train.quant.scaling`, with exact, not power-of-two, scales)::

    scale = 448 / amax(block)   (1 for an all-zero block)
    weight_fp8 = saturating round-to-nearest-even cast of weight * scale
    weight_scale_inv = 1 / scale

which is what transformers' ``Fp8Quantize`` computes for the blocks it can tile. With
E8M0 scales the scale is rounded down to a power of two first (fp8train's
``power_2_scales``), so ``weight_scale_inv`` is ``amax / 448`` rounded up to one and no
value saturates.
"""

from __future__ import annotations

import math

import torch

from ..quant.quantize import quantize
from ..spec.formats import E4M3
from ..spec.granularities import Granularity
from ..spec.rule import QuantRule
from .format_base import checked_weight

__all__ = ["BLOCK_SIZE", "WEIGHT_BLOCK_RULE", "UE8M0_WEIGHT_BLOCK_RULE", "quantize_weight_blocks", "scale_grid_shape"]

WEIGHT_BLOCK_RULE = QuantRule(granularity=Granularity.BLOCK_128X128, format=E4M3, power_2_scales=False)
"""The checkpoint format's rule: 128x128 blocks, E4M3 data, exact float32 scales."""
UE8M0_WEIGHT_BLOCK_RULE = QuantRule(granularity=Granularity.BLOCK_128X128, format=E4M3, power_2_scales=True)
"""The ``scale_fmt: ue8m0`` variant's: the same blocks, every scale a power of two."""
BLOCK_SIZE = WEIGHT_BLOCK_RULE.granularity.block


def scale_grid_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """``[ceil(out/128), ceil(in/128)]``: the shape of a ``[out, in]`` weight's ``weight_scale_inv``."""
    return math.ceil(out_features / BLOCK_SIZE), math.ceil(in_features / BLOCK_SIZE)


def quantize_weight_blocks(weight: torch.Tensor, rule: QuantRule = WEIGHT_BLOCK_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a Linear's ``[out, in]`` weight to the checkpoint format (``rule``:
    :data:`WEIGHT_BLOCK_RULE` or :data:`UE8M0_WEIGHT_BLOCK_RULE`).

    A dim that is not a multiple of 128 ends in a partial block: the weight is padded with
    zeros to whole blocks (zeros do not change a block's amax), quantized, and the padding
    cut off again.

    Args:
        weight: float32, bfloat16 or float16 ``[out, in]`` tensor, every value finite.

    Returns:
        ``(weight_fp8, weight_scale_inv)``: ``float8_e4m3fn`` ``[out, in]`` and float32
        ``[ceil(out/128), ceil(in/128)]``, both contiguous, on ``weight``'s device.

    Raises:
        ValueError: ``weight`` is not 2-D, or holds a NaN or an infinity.
    """
    weight = checked_weight(weight)
    rows, cols = weight.shape
    grid_rows, grid_cols = scale_grid_shape(rows, cols)
    padding = (0, grid_cols * BLOCK_SIZE - cols, 0, grid_rows * BLOCK_SIZE - rows)
    padded = torch.nn.functional.pad(weight, padding) if any(padding) else weight
    quantized = quantize(padded, rule)
    weight_fp8 = quantized.data[:rows, :cols].contiguous()
    return weight_fp8, quantized.scale_inv.to(torch.float32).contiguous()
