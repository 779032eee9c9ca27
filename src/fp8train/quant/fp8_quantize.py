"""FP8 quantization's reference path (NUMERICS.md sections 2-3), in PyTorch ops on any
device: the path every faster FP8 quantizer is held to, bit for bit.

Every granularity is one rule over *scaling groups* of the 2-D view ``(M, K)`` of the input
(leading dims flattened); the groups of each granularity are described, once, in
:mod:`fp8train.spec.granularities`. The scale convention ``data = cast(x * scale)`` is
defined in :mod:`fp8train.quant.scaling`. The FP8 family's door
(:func:`fp8train.quant.quantize.quantize`) calls :func:`quantize_fp8` where no kernel takes
the tensor; :func:`fp8_tensor` assembles the :class:`QuantizedTensor` of every FP8 path.
"""

from __future__ import annotations

import math

import torch

from ..spec.granularities import Granularity, view_2d_shape
from ..spec.rule import QuantRule
from .cast import CHUNK_ELEMENTS, DTYPE_BY_NAME, checked_scratch_to_fp8
from .scaling import FLOAT32_MAX, checked_amax_to_scale, exp2_int, mx_scale_exponent
from .tensor import QuantizedTensor, quantized_tensor

__all__ = ["quantize_fp8", "fp8_tensor", "group_amax", "group_scales", "reciprocal"]


def group_amax(x_groups: torch.Tensor) -> torch.Tensor:
    """``max |x|`` per group of a ``(row groups, rows, col groups, cols)`` view, in ``x``'s
    dtype (exact: a magnitude of ``x``), keeping all four dims. NaN propagates; an empty
    group gives 0."""
    num_row_groups, rows, num_col_groups, cols = x_groups.shape
    if x_groups.numel() == 0:
        return x_groups.new_zeros(num_row_groups, 1, num_col_groups, 1)
    if num_row_groups == num_col_groups == 1:
        low, high = torch.aminmax(x_groups)
        return torch.maximum(-low, high).reshape(1, 1, 1, 1)
    # max |x| in one pass with no |x| temporary: one GPU launch, and on CPU as fast as abs
    # then amax or faster.
    return torch.linalg.vector_norm(x_groups, math.inf, dim=(1, 3), keepdim=True)


def _scale_and_cast(
    x_groups: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, scales_are_powers_of_2: bool
) -> torch.Tensor:
    """``cast_to_fp8(x_groups * scale)`` with the product rounded as float32 would round it.

    On CPU the work runs in chunks of whole row groups (or rows) so the scaled intermediate
    never has to be allocated, and paged in, at full size.
    """

    def scale_and_cast(x_part: torch.Tensor, scale_part: torch.Tensor, convert_first: bool) -> torch.Tensor:
        if scales_are_powers_of_2 and x_part.dtype == torch.bfloat16:
            # bfloat16 has float32's exponent range, so x * 2^k is exact in bfloat16 wherever
            # it can reach a non-zero FP8 value: the same product as float32, at half the traffic.
            scaled = x_part * scale_part.to(torch.bfloat16)
        elif x_part.dtype == torch.float32 or not convert_first:
            # scale is float32 and not 0-dim, so a 16-bit x is promoted: float32(x) * scale,
            # exact conversion then one float32 rounding, in one op (one launch, no converted copy).
            scaled = x_part * scale_part
        else:
            scaled = x_part.to(torch.float32).mul_(scale_part)  # on CPU, faster than promotion
        return checked_scratch_to_fp8(scaled, dtype)  # `scaled` is this call's own product (x checked by the door)

    if x_groups.device.type != "cpu" or x_groups.numel() <= CHUNK_ELEMENTS or torch.compiler.is_compiling():
        return scale_and_cast(x_groups, scale, convert_first=False)
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
        (out[part] if dim == 0 else out[:, part]).copy_(scale_and_cast(x_part, scale_part, convert_first=True))
    return out


def group_scales(amax, rule: QuantRule, x_dtype, divide_in: torch.dtype = torch.float32):
    """``(scale, scale_inv)`` of every group from its amax. E8M0 scales come back as their
    uint8 exponent bits in ``scale_inv``. ``divide_in``: the dtype of the divisions (the
    quotient and the reciprocal), as :func:`~fp8train.quant.scaling.amax_to_scale` takes it:
    float64 gives the same bits where float32 division is not correctly rounded."""
    granularity = rule.granularity
    if granularity.e8m0_scales:
        amax = amax.to(torch.float32)
        if rule.amax_epsilon > 0:
            amax = torch.where(amax < rule.amax_epsilon, torch.full_like(amax, rule.amax_epsilon), amax)
        exponent = mx_scale_exponent(amax, rule.fp8_max, rule.mx_scale_rule)
        scale = exp2_int(127 - exponent.to(torch.int32))
        # A NaN anywhere in a block makes the whole block NaN.
        scale = torch.where(exponent == 0xFF, torch.full_like(scale, math.nan), scale)
        return scale, exponent
    # Block scales that overflow take the input dtype's largest value (NUMERICS.md).
    inf_scale_value = torch.finfo(x_dtype).max if granularity.block else FLOAT32_MAX
    # The rule's fields were checked when it was built, and amax is this quantization's own.
    scale = checked_amax_to_scale(
        amax, rule.fp8_max, rule.power_2_scales, rule.amax_epsilon, inf_scale_value, divide_in
    )
    return scale, reciprocal(scale, divide_in)


def reciprocal(scale: torch.Tensor, divide_in: torch.dtype = torch.float32) -> torch.Tensor:
    """``1 / scale`` as float32 (one op in float32; float64 gives the same bits)."""
    if divide_in == torch.float32:
        return torch.reciprocal(scale)
    return torch.reciprocal(scale.to(divide_in)).to(torch.float32)


def _quantize_reference(x_groups, rule: QuantRule, scale):
    """``(data, scale_inv)`` in PyTorch ops: the reference every faster path is held to."""
    scales_are_powers_of_2 = rule.granularity.always_power_2 or (rule.power_2_scales and scale is None)
    if scale is None:
        scale, scale_inv = group_scales(group_amax(x_groups), rule, x_groups.dtype)
    else:
        scale = scale.to(device=x_groups.device, dtype=torch.float32).reshape(1, 1, 1, 1)
        scale_inv = torch.reciprocal(scale)
    dtype = DTYPE_BY_NAME[rule.format.dtype_name]  # the rule's format is checked: no torch_dtype
    return _scale_and_cast(x_groups, scale, dtype, scales_are_powers_of_2), scale_inv


def quantize_fp8(
    x: torch.Tensor, rule: QuantRule, axis: int, scale: torch.Tensor | None, generator=None, global_amax=None,
    *, traced: bool | None = None,
) -> QuantizedTensor:
    """``x`` (checked by :func:`fp8train.quant.quantize.quantize`; ``axis`` normalized)
    quantized by the FP8 ``rule`` along ``axis``, one scale per scaling group (``scale``: a
    given per-tensor scale). (``generator`` and ``global_amax``: the door's uniform
    signature; FP8 rules use neither. ``traced``: whether ``torch.compile`` traces this,
    where the caller knows: ``False`` for a layer's bound kernels; ``None`` asks.)"""
    m, k = view_2d_shape(x.shape)
    rows, cols = rule.granularity.group_shape(axis, (m, k))
    x_groups = x.reshape(m // rows if rows else 1, rows, k // cols if cols else 1, cols)
    data, scale_inv = _quantize_reference(x_groups, rule, scale)
    power_2 = rule.power_2_scales and scale is None
    return fp8_tensor(x, data, scale_inv, rule.granularity, axis, power_2, (m, k), traced)


def fp8_tensor(
    x, data, scale_inv, granularity: Granularity, axis: int, computed_power_2: bool, shape_2d=None, traced=None
) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of ``x`` from its codes and its groups' ``scale_inv``
    (``shape_2d``: ``x``'s 2-D view where the caller has it already; ``traced``: whether
    ``torch.compile`` traces this, where the caller knows, ``None`` asks)."""
    if traced is None:
        traced = torch.compiler.is_compiling()
    if granularity.per_tensor:
        scale_inv = scale_inv if scale_inv.shape == () else scale_inv.reshape(())
    else:
        m, k = view_2d_shape(x.shape) if shape_2d is None else shape_2d
        rows, cols = granularity.group_shape(axis, (m, k))
        scale_inv = scale_inv.reshape(m // rows if rows else 1, k // cols if cols else 1)
    if granularity.e8m0_scales and not traced:
        # Inside torch.compile the scales stay as their uint8 bits: inductor (torch 2.13)
        # has no E8M0 kernels, and every reader here takes either dtype.
        scale_inv = scale_inv.view(torch.float8_e8m0fnu)
    data = data if data.shape == x.shape else data.reshape(x.shape)
    power_2 = granularity.always_power_2 or computed_power_2
    return quantized_tensor(data, scale_inv, granularity, axis, power_2, None, not traced)
