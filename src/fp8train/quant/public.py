"""The public ``fp8train.quantize``: a granularity and loose options in, one
:class:`~fp8train.spec.rule.QuantRule` built from them, :func:`fp8train.quant.quantize.quantize`
run with it. Everything inside the library passes a rule (an operand plan's slots hold one)."""

from __future__ import annotations

import torch

from ..spec.granularities import Granularity
from ..spec.rule import QuantRule
from .cast import FP8_DATA_DTYPES, format_of
from .quantize import quantize as quantize_by_rule
from .tensor import QuantizedTensor

__all__ = ["quantize"]


def quantize(
    x: torch.Tensor,
    granularity: Granularity | str,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    axis: int = -1,
    power_2_scales: bool | None = None,
    amax_epsilon: float = 0.0,
    scale: torch.Tensor | None = None,
    mx_scale_rule: str = "ceil",
) -> QuantizedTensor:
    """Quantize ``x`` to FP8 with one scale per scaling group (NUMERICS.md sections 2-3).

    Args:
        x: float32, bfloat16 or float16 tensor. Ranks > 2 behave as their 2-D view
            ``(prod(leading dims), last dim)``; any strides.
        granularity: ``"tensor"``, ``"row"``, ``"block1x128"``, ``"block128x128"`` or ``"mx"``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        axis: -1 puts the scaling groups along the last dim (rowwise usage), 0 along the
            first (columnwise usage). Ignored by ``tensor`` and ``block128x128``.
        power_2_scales: round scales down to powers of two. ``None`` takes the recipe
            default: off for ``tensor``, on for ``row`` and the block granularities.
            ``mx`` scales are always powers of two.
        amax_epsilon: lower bound applied to each group's amax.
        scale: a precomputed float32 scale (``tensor`` granularity only, e.g. delayed
            scaling); skips the amax pass.
        mx_scale_rule: ``"ceil"`` (default, never saturates) or ``"ocp"``; ``mx`` only.

    Returns:
        A :class:`QuantizedTensor` whose ``data`` has ``x``'s shape.

    Raises:
        ValueError: unknown granularity, unsupported dtype or axis, or a shape the
            granularity cannot tile (rank < 2, or a dim not divisible by the block); a
            negative or non-finite ``amax_epsilon``; an unknown ``mx_scale_rule``.
        TypeError: ``x`` or ``scale`` not a tensor, ``axis`` not an int,
            ``power_2_scales`` not a bool.
    """
    if dtype not in FP8_DATA_DTYPES:
        raise ValueError(f"dtype={dtype} is not an FP8 data dtype; use torch.float8_e4m3fn or torch.float8_e5m2")
    rule = QuantRule(
        granularity=granularity,
        format=format_of(dtype),
        power_2_scales=power_2_scales,
        amax_epsilon=amax_epsilon,
        mx_scale_rule=mx_scale_rule,
    )
    return quantize_by_rule(x, rule, axis=axis, scale=scale)
