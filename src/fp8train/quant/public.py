"""The public ``fp8train.quant.quantize``: a granularity and loose options in, one
:class:`~fp8train.spec.rule.QuantRule` built from them (by
:func:`~fp8train.spec.rule.build_quantize_rule`, which ``fp8train.jax.quantize`` shares),
:func:`fp8train.quant.quantize.quantize` run with it. Everything inside the library passes a rule (an operand plan's slots hold one)."""

from __future__ import annotations

import torch

from ..spec.granularities import Granularity
from ..spec.rule import build_quantize_rule
from ..spec.formats import E2M1
from .cast import FP8_DATA_DTYPES, format_of
from .quantize import quantize as quantize_by_rule
from .tensor import QuantizedTensor

__all__ = ["quantize"]


def quantize(
    x: torch.Tensor,
    granularity: Granularity | str,
    *,
    dtype: torch.dtype | None = None,
    axis: int = -1,
    power_2_scales: bool | None = None,
    amax_epsilon: float = 0.0,
    scale: torch.Tensor | None = None,
    mx_scale_rule: str = "ceil",
    rht: bool = False,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` to FP8 or 4 bits with one scale per scaling group (NUMERICS.md 2-3, 6).

    Args:
        x: float32, bfloat16 or float16 tensor. Ranks > 2 behave as their 2-D view
            ``(prod(leading dims), last dim)``; any strides.
        granularity: FP8 data: ``"tensor"``, ``"row"``, ``"block1x128"``, ``"block128x128"``,
            ``"mx"``; 4-bit E2M1 data: ``"nvfp4"`` (1x16, E4M3 scales, a global amax),
            ``"nvfp4_2d"`` (16x16 tiles), ``"mxfp4"`` (1x32, E8M0 scales).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (FP8), ``torch.float4_e2m1fn_x2``
            (4-bit); ``None``: E4M3, or E2M1 for a 4-bit granularity.
        axis: -1 puts the scaling groups along the last dim (rowwise usage), 0 along the
            first (columnwise usage). Ignored by ``tensor``, ``block128x128`` and ``nvfp4_2d``.
        power_2_scales: round scales down to powers of two. ``None``: off for ``tensor`` and
            NVFP4, on for the others; always on for E8M0 scales (``mx``, ``mxfp4``).
        amax_epsilon: lower bound applied to each group's amax (0 for 4-bit).
        scale: a precomputed float32 scale (``tensor`` only, e.g. delayed scaling).
        mx_scale_rule: ``"ceil"`` (default, never saturates) or ``"ocp"``; ``mx``, ``mxfp4``.
        rht: the random Hadamard transform along the scaling axis first (``nvfp4`` only).
        stochastic_rounding: round the E2M1 cast stochastically (4-bit granularities), from
            ``generator`` (``None``: the default one); the same state gives the same bits.

    Returns:
        A :class:`QuantizedTensor` whose ``data`` has ``x``'s shape (4-bit: packed two values
        a byte along the scaling axis: ``[..., K/2]`` for axis -1, ``[M/2, K]`` for axis 0).

    Raises:
        ValueError: unknown granularity; a dtype, axis or shape it cannot take (rank < 2,
            a dim not divisible by the block); a bad ``amax_epsilon`` or ``mx_scale_rule``;
            ``rht`` or ``stochastic_rounding`` where they do not apply.
        TypeError: ``x`` or ``scale`` not a tensor, ``axis`` not an int, a flag not a bool,
            ``generator`` not a ``torch.Generator``.
    """
    rule = build_quantize_rule(
        granularity, _format_of_dtype(dtype), power_2_scales=power_2_scales, amax_epsilon=amax_epsilon,
        mx_scale_rule=mx_scale_rule, rht=rht, stochastic_rounding=stochastic_rounding,
    )
    return quantize_by_rule(x, rule, axis=axis, scale=scale, generator=generator)


def _format_of_dtype(dtype: torch.dtype | None):
    """The data format of ``dtype`` (``None``: the granularity's default)."""
    if dtype is None:
        return None
    if dtype == torch.float4_e2m1fn_x2:
        return E2M1
    if dtype not in FP8_DATA_DTYPES:
        raise ValueError(
            f"dtype={dtype} is not an FP8 data dtype; use torch.float8_e4m3fn or torch.float8_e5m2, "
            "or torch.float4_e2m1fn_x2 with a 4-bit granularity"
        )
    return format_of(dtype)
