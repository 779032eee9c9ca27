"""Quantization: a high-precision tensor and a :class:`~fp8train.spec.rule.QuantRule` in, a
:class:`~fp8train.quant.tensor.QuantizedTensor` out.

Every granularity is one rule over *scaling groups* of the 2-D view ``(M, K)`` of the input
(leading dims flattened); the groups of each granularity are described, once, in
:mod:`fp8train.spec.granularities`. The scale convention ``data = cast(x * scale)`` is
defined in :mod:`fp8train.quant.scaling`. On CPU the fused kernels of
:mod:`fp8train.quant.kernels` compute the same bits where they apply; the PyTorch ops here
are the reference. The public ``fp8train.quant.quantize`` (a granularity and options) builds a
rule and calls :func:`quantize` (:mod:`fp8train.quant.public`).
"""

from __future__ import annotations

import math

import torch

from ..spec.checks import check_type
from ..spec.granularities import view_2d_shape
from ..spec.rule import QuantRule
from . import kernels
from .cast import CHUNK_ELEMENTS, HIGH_PRECISION_DTYPES, cast_scratch_to_fp8, check_tensor, torch_dtype
from .fp4_quantize import quantize_fp4
from .scaling import FLOAT32_MAX, amax_to_scale, exp2_int, mx_scale_exponent
from .tensor import QuantizedTensor

__all__ = ["quantize", "quantize_both"]


def _group_amax(x_groups: torch.Tensor) -> torch.Tensor:
    """``max |x|`` per group of a ``(row groups, rows, col groups, cols)`` view, float32,
    keeping all four dims. NaN propagates; an empty group gives 0."""
    num_row_groups, rows, num_col_groups, cols = x_groups.shape
    if x_groups.numel() == 0:
        return torch.zeros(num_row_groups, 1, num_col_groups, 1, device=x_groups.device)
    if num_row_groups == num_col_groups == 1:
        low, high = torch.aminmax(x_groups)
        return torch.maximum(-low, high).to(torch.float32).reshape(1, 1, 1, 1)
    # Reduce the strided dim first (vectorizes across the contiguous one), then the
    # contiguous dim in float32 (PyTorch's short inner reductions are slow in 16-bit).
    magnitude = x_groups.abs()
    if rows > 1:
        magnitude = magnitude.amax(dim=1, keepdim=True)
    return magnitude.to(torch.float32).amax(dim=3, keepdim=True)


def _scale_and_cast(
    x_groups: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, scales_are_powers_of_2: bool
) -> torch.Tensor:
    """``cast_to_fp8(x_groups * scale)`` with the product rounded as float32 would round it.

    On CPU the work runs in chunks of whole row groups (or rows) so the scaled intermediate
    never has to be allocated, and paged in, at full size.
    """

    def scale_and_cast(x_part: torch.Tensor, scale_part: torch.Tensor) -> torch.Tensor:
        if scales_are_powers_of_2 and x_part.dtype == torch.bfloat16:
            # bfloat16 has float32's exponent range, so x * 2^k is exact in bfloat16 wherever
            # it can reach a non-zero FP8 value: the same product as float32, at half the traffic.
            scaled = x_part * scale_part.to(torch.bfloat16)
        elif x_part.dtype == torch.float32:
            scaled = x_part * scale_part  # scale is float32 and not 0-dim: no demotion
        else:
            scaled = x_part.to(torch.float32).mul_(scale_part)  # converting first beats promotion
        return cast_scratch_to_fp8(scaled, dtype)  # `scaled` is this call's own product

    if x_groups.device.type != "cpu" or torch.compiler.is_compiling() or x_groups.numel() <= CHUNK_ELEMENTS:
        return scale_and_cast(x_groups, scale)
    # Chunk along the row groups when there are several, else along the rows of the one group
    # (the scale is constant along that dim then).
    dim = 0 if x_groups.shape[0] > 1 else 1
    per_index = x_groups.numel() // x_groups.shape[dim]
    step = max(1, CHUNK_ELEMENTS // per_index)
    out = torch.empty(x_groups.shape, dtype=dtype)
    for start in range(0, x_groups.shape[dim], step):
        part = slice(start, start + step)
        x_part = x_groups[part] if dim == 0 else x_groups[:, part]
        scale_part = scale[part] if dim == 0 else scale
        (out[part] if dim == 0 else out[:, part]).copy_(scale_and_cast(x_part, scale_part))
    return out


def _check_arguments(x, rule: QuantRule, axis, scale, generator=None, global_amax=None) -> int:
    """Validate :func:`quantize`'s arguments; return the normalized axis."""
    check_tensor("x", x)
    check_type("rule", rule, QuantRule, "a QuantRule (fp8train.spec.QuantRule)")
    if generator is not None:
        check_type("generator", generator, torch.Generator, "a torch.Generator")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"quantize takes float32, bfloat16 or float16 input, got {x.dtype}")
    if scale is not None:
        check_tensor("scale", scale)
    axis = rule.check_input(tuple(x.shape), axis, scale_given=scale is not None, noun="tensor")
    if scale is not None and (scale.numel() != 1 or not scale.is_floating_point()):
        raise ValueError(
            f"scale must be a one-element floating-point tensor, got shape {tuple(scale.shape)} of {scale.dtype}"
        )
    if global_amax is not None:
        _check_global_amax(global_amax, rule)
    return axis


def _check_global_amax(global_amax, rule: QuantRule) -> None:
    check_tensor("global_amax", global_amax)
    if not rule.granularity.two_level_scales:
        raise ValueError(
            f"global_amax is for NVFP4's two-level scales ('nvfp4', 'nvfp4_2d'), not granularity "
            f"{str(rule.granularity)!r}; leave it None"
        )
    if global_amax.numel() != 1 or global_amax.dtype != torch.float32:
        raise ValueError(
            f"global_amax must be a one-element float32 tensor, got shape {tuple(global_amax.shape)} of "
            f"{global_amax.dtype}"
        )


def _group_scales(amax, rule: QuantRule, x_dtype):
    """``(scale, scale_inv)`` of every group from its amax. E8M0 scales come back as their
    uint8 exponent bits in ``scale_inv``."""
    granularity = rule.granularity
    if granularity.e8m0_scales:
        if rule.amax_epsilon > 0:
            amax = torch.where(amax < rule.amax_epsilon, torch.full_like(amax, rule.amax_epsilon), amax)
        exponent = mx_scale_exponent(amax, rule.fp8_max, rule.mx_scale_rule)
        scale = exp2_int(127 - exponent.to(torch.int32))
        # A NaN anywhere in a block makes the whole block NaN.
        scale = torch.where(exponent == 0xFF, torch.full_like(scale, math.nan), scale)
        return scale, exponent
    # Block scales that overflow take the input dtype's largest value (NUMERICS.md).
    inf_scale_value = torch.finfo(x_dtype).max if granularity.block else FLOAT32_MAX
    scale = amax_to_scale(
        amax,
        rule.fp8_max,
        power_2_scales=rule.power_2_scales,
        amax_epsilon=rule.amax_epsilon,
        inf_scale_value=inf_scale_value,
    )
    return scale, 1.0 / scale


def _quantize_reference(x_groups, rule: QuantRule, scale):
    """``(data, scale_inv)`` in PyTorch ops: the reference every faster path is held to."""
    scales_are_powers_of_2 = rule.granularity.always_power_2 or (rule.power_2_scales and scale is None)
    if scale is None:
        scale, scale_inv = _group_scales(_group_amax(x_groups), rule, x_groups.dtype)
    else:
        scale = scale.to(device=x_groups.device, dtype=torch.float32).reshape(1, 1, 1, 1)
        scale_inv = 1.0 / scale
    return _scale_and_cast(x_groups, scale, torch_dtype(rule.format), scales_are_powers_of_2), scale_inv


def quantize(
    x: torch.Tensor,
    rule: QuantRule,
    *,
    axis: int = -1,
    scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    global_amax: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` to FP8 (or 4 bits) by ``rule``, one scale per scaling group
    (NUMERICS.md sections 2-3 and 6).

    Args:
        x: float32, bfloat16 or float16 tensor. Ranks > 2 behave as their 2-D view
            ``(prod(leading dims), last dim)``; any strides.
        rule: the granularity, format and scale rule (:class:`~fp8train.spec.rule.QuantRule`).
        axis: -1 puts the scaling groups along the last dim (rowwise usage), 0 along the
            first (columnwise usage). Ignored by ``tensor`` and ``block128x128``.
        scale: a precomputed float32 scale (per-tensor rules only, e.g. delayed scaling);
            skips the amax pass.
        generator: where stochastic rounding (``rule.stochastic_rounding``) draws from
            (``None``: PyTorch's default generator); unused otherwise.
        global_amax: NVFP4 only (``nvfp4``, ``nvfp4_2d``): the one-element float32 amax of
            the whole tensor ``x`` is part of (after the transform, where ``rule.rht``), in
            place of ``x``'s own: every shard of a distributed tensor quantized with the
            MAX of the shards' amaxes gets the codes and scales of the whole tensor's
            quantization (:mod:`fp8train.parallel.gather`). ``None``: ``x``'s own amax.

    Returns:
        A :class:`QuantizedTensor` whose ``data`` has ``x``'s shape (4-bit: packed two
        values a byte along the scaling axis, :mod:`fp8train.quant.fp4_quantize`).

    Raises:
        ValueError: an input dtype other than float32, bfloat16 or float16; an unsupported
            axis, or a shape the granularity cannot tile (rank, or a dim not divisible by
            the block); a scale with a rule that is not per-tensor, or not one float.
            A ``global_amax`` for a granularity other than NVFP4's, or not one float32.
        TypeError: ``x``, ``scale`` or ``global_amax`` not a tensor, ``rule`` not a
            QuantRule, ``axis`` not an int, ``generator`` not a ``torch.Generator``.
    """
    axis = _check_arguments(x, rule, axis, scale, generator, global_amax)
    granularity = rule.granularity
    if granularity.fp4:
        # Its own CPU kernel where one applies (fp8train.quant.fp4_kernels), else the reference.
        return quantize_fp4(x, rule, axis, generator, global_amax)
    m, k = view_2d_shape(x.shape)
    rows, cols = granularity.group_shape(axis, (m, k))
    fused = kernels.try_quantize(x, rule, axis, scale)
    if fused is not None:
        codes, scale_inv = fused
        data = codes.view(torch_dtype(rule.format))
    else:
        x_groups = x.reshape(m // rows if rows else 1, rows, k // cols if cols else 1, cols)
        data, scale_inv = _quantize_reference(x_groups, rule, scale)
    return _assemble(x, data, scale_inv, granularity, axis, rule.power_2_scales and scale is None)


def _assemble(x, data, scale_inv, granularity: Granularity, axis: int, computed_power_2: bool) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of ``x`` from its codes and its groups' ``scale_inv``."""
    m, k = view_2d_shape(x.shape)
    rows, cols = granularity.group_shape(axis, (m, k))
    scale_inv = scale_inv.reshape(m // rows if rows else 1, k // cols if cols else 1)
    if granularity.e8m0_scales and not torch.compiler.is_compiling():
        # Inside torch.compile the scales stay as their uint8 bits: inductor (torch 2.13)
        # has no E8M0 kernels, and every reader here takes either dtype.
        scale_inv = scale_inv.view(torch.float8_e8m0fnu)
    if granularity.per_tensor:
        scale_inv = scale_inv.reshape(())
    return QuantizedTensor(
        data=data.reshape(x.shape),
        scale_inv=scale_inv,
        granularity=granularity,
        axis=axis,
        power_2_scales=granularity.always_power_2 or computed_power_2,
    )


def quantize_both(x: torch.Tensor, rule: QuantRule) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Both usages of ``x`` by ``rule``: ``(quantize(x, rule, axis=-1), quantize(x, rule, axis=0))``.

    Equal, bit for bit, to the two calls. On CPU the ``row``, ``block1x128`` and ``mx``
    granularities read ``x`` once for both (twice for ``row``), where the two calls read it
    two to three times. Arguments and errors as :func:`quantize`.
    """
    _check_arguments(x, rule, 0, None)
    fused = kernels.try_quantize_both(x, rule)
    if fused is None:
        return quantize(x, rule, axis=-1), quantize(x, rule, axis=0)
    dtype = torch_dtype(rule.format)
    return tuple(
        _assemble(x, codes.view(dtype), scale_inv, rule.granularity, axis, rule.power_2_scales)
        for axis, (codes, scale_inv) in ((-1, fused[0]), (0, fused[1]))
    )
