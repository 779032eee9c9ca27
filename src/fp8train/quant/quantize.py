"""Quantization: a high-precision tensor in, a :class:`~fp8train.quant.tensor.QuantizedTensor` out.

Every granularity is one rule over *scaling groups* of the 2-D view ``(M, K)`` of the input
(leading dims flattened); the groups of each granularity are described, once, in
:mod:`fp8train.spec.granularities`. The scale convention ``data = cast(x * scale)`` is
defined in :mod:`fp8train.quant.scaling`.
"""

from __future__ import annotations

import math

import torch

from ..spec.checks import check_bool, check_number
from ..spec.granularities import Granularity, normalize_axis
from ..spec.recipes import MX_SCALE_RULES
from . import kernels
from .cast import CHUNK_ELEMENTS, FP8_DATA_DTYPES, HIGH_PRECISION_DTYPES, cast_to_fp8, check_tensor, format_of
from .scaling import FLOAT32_MAX, amax_to_scale, exp2_int, mx_scale_exponent
from .kernels import kernels_usable
from .tensor import QuantizedTensor, view_2d_shape

__all__ = ["quantize", "quantize_both"]


def _check_shape(x: torch.Tensor, granularity: Granularity) -> None:
    if x.dim() < granularity.min_rank:
        raise ValueError(
            f"granularity {str(granularity)!r} needs a tensor of rank >= {granularity.min_rank}, "
            f"got shape {tuple(x.shape)}"
        )
    block = granularity.block
    if not block:
        return
    m, k = view_2d_shape(x.shape)
    if k % block or m % block:
        raise ValueError(
            f"granularity {str(granularity)!r} needs the last dim and the product of the other dims to "
            f"be divisible by {block}; shape {tuple(x.shape)} gives {m} x {k}. Pad the tensor, or "
            f"skip FP8 for this layer"
        )


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
        return cast_to_fp8(scaled, dtype)

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


def _check_arguments(x, granularity: Granularity, dtype, axis, power_2_scales, amax_epsilon, scale, mx_scale_rule) -> int:
    """Validate :func:`quantize`'s arguments; return the normalized axis."""
    check_tensor("x", x)
    if dtype not in FP8_DATA_DTYPES:
        raise ValueError(f"dtype={dtype} is not an FP8 data dtype; use torch.float8_e4m3fn or torch.float8_e5m2")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"quantize takes float32, bfloat16 or float16 input, got {x.dtype}")
    axis = -1 if granularity.per_tensor else normalize_axis(axis, x.dim())
    _check_shape(x, granularity)
    if scale is not None and not granularity.per_tensor:
        raise ValueError(
            f"a precomputed scale is only supported for granularity 'tensor', not {str(granularity)!r}"
        )
    if scale is not None and (check_tensor("scale", scale).numel() != 1 or not scale.is_floating_point()):
        raise ValueError(
            f"scale must be a one-element floating-point tensor, got shape {tuple(scale.shape)} of {scale.dtype}"
        )
    if power_2_scales is not None:
        check_bool("power_2_scales", power_2_scales)
    if granularity.always_power_2 and power_2_scales is False:
        raise ValueError(
            f"power_2_scales=False is not possible for {str(granularity)!r}: E8M0 scales are powers of two"
        )
    check_number("amax_epsilon", amax_epsilon, minimum=0)
    if not isinstance(mx_scale_rule, str) or mx_scale_rule not in MX_SCALE_RULES:
        raise ValueError(f"mx_scale_rule={mx_scale_rule!r} must be 'ceil' or 'ocp'")
    return axis


def _group_scales(amax, granularity: Granularity, fp8_max, x_dtype, power_2_scales, amax_epsilon, mx_scale_rule):
    """``(scale, scale_inv)`` of every group from its amax. E8M0 scales come back as their
    uint8 exponent bits in ``scale_inv``."""
    if granularity.e8m0_scales:
        if amax_epsilon > 0:
            amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
        exponent = mx_scale_exponent(amax, fp8_max, mx_scale_rule)
        scale = exp2_int(127 - exponent.to(torch.int32))
        # A NaN anywhere in a block makes the whole block NaN.
        scale = torch.where(exponent == 0xFF, torch.full_like(scale, math.nan), scale)
        return scale, exponent
    # Block scales that overflow take the input dtype's largest value (NUMERICS.md).
    inf_scale_value = torch.finfo(x_dtype).max if granularity.block else FLOAT32_MAX
    scale = amax_to_scale(
        amax, fp8_max, power_2_scales=power_2_scales, amax_epsilon=amax_epsilon, inf_scale_value=inf_scale_value
    )
    return scale, 1.0 / scale


def _quantize_reference(x_groups, granularity: Granularity, dtype, power_2_scales, amax_epsilon, scale, mx_scale_rule):
    """``(data, scale_inv)`` in PyTorch ops: the reference every faster path is held to."""
    scales_are_powers_of_2 = granularity.always_power_2 or (power_2_scales and scale is None)
    if scale is None:
        amax = _group_amax(x_groups)
        scale, scale_inv = _group_scales(
            amax, granularity, format_of(dtype).max, x_groups.dtype, power_2_scales, amax_epsilon, mx_scale_rule
        )
    else:
        scale = scale.to(device=x_groups.device, dtype=torch.float32).reshape(1, 1, 1, 1)
        scale_inv = 1.0 / scale
    return _scale_and_cast(x_groups, scale, dtype, scales_are_powers_of_2), scale_inv


def _quantize_with_kernels(x2d, granularity: Granularity, dtype, group, power_2_scales, amax_epsilon, scale, mx_scale_rule):
    """``(data, scale_inv)`` from the fused CPU kernels (:mod:`fp8train.quant.kernels`),
    bit-identical to :func:`_quantize_reference`."""
    fmt = format_of(dtype)
    x2d = x2d.contiguous()
    rule = _kernel_scale_rule(granularity, fmt, x2d.dtype, power_2_scales, amax_epsilon, mx_scale_rule)
    if granularity.per_tensor and scale is None:
        codes, scale_inv = kernels.quantize_tensor(x2d, fmt, rule)
        return codes.view(dtype), scale_inv
    if granularity.per_tensor:
        scale = scale.to(dtype=torch.float32)
        return kernels.cast_with_scale(x2d, float(scale), fmt).view(dtype), 1.0 / scale
    codes, scale_inv = kernels.quantize_groups(x2d, *group, fmt, rule)
    return codes.view(dtype), scale_inv


def _kernel_scale_rule(granularity: Granularity, fmt, x_dtype, power_2_scales, amax_epsilon, mx_scale_rule):
    return kernels.GroupScaleRule(
        fp8_max=fmt.max,
        power_2_scales=power_2_scales,
        amax_epsilon=amax_epsilon,
        inf_scale_value=torch.finfo(x_dtype).max if granularity.block else FLOAT32_MAX,
        e8m0=granularity.e8m0_scales,
        mx_scale_rule=mx_scale_rule,
    )


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
    granularity = Granularity.coerce(granularity)
    axis = _check_arguments(x, granularity, dtype, axis, power_2_scales, amax_epsilon, scale, mx_scale_rule)
    if power_2_scales is None:
        power_2_scales = granularity.default_power_2_scales
    m, k = view_2d_shape(x.shape)
    rows, cols = granularity.group_shape(axis, (m, k))
    if kernels_usable(x):
        data, scale_inv = _quantize_with_kernels(
            x.reshape(m, k), granularity, dtype, (rows, cols), power_2_scales, amax_epsilon, scale, mx_scale_rule
        )
    else:
        x_groups = x.reshape(m // rows if rows else 1, rows, k // cols if cols else 1, cols)
        data, scale_inv = _quantize_reference(
            x_groups, granularity, dtype, power_2_scales, amax_epsilon, scale, mx_scale_rule
        )
    return _assemble(x, data, scale_inv, granularity, axis, power_2_scales and scale is None)


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


def quantize_both(
    x: torch.Tensor,
    granularity: Granularity | str,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    power_2_scales: bool | None = None,
    amax_epsilon: float = 0.0,
    mx_scale_rule: str = "ceil",
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Both usages of ``x``: ``(quantize(x, axis=-1, ...), quantize(x, axis=0, ...))``.

    Equal, bit for bit, to the two calls. On CPU the ``row``, ``block1x128`` and ``mx``
    granularities read ``x`` once for both (twice for ``row``), where the two calls read it
    two to three times. Arguments as :func:`quantize`.
    """
    granularity = Granularity.coerce(granularity)
    kwargs = dict(dtype=dtype, power_2_scales=power_2_scales, amax_epsilon=amax_epsilon, mx_scale_rule=mx_scale_rule)
    if granularity.symmetric or granularity.across != 1 or not kernels_usable(x):
        return quantize(x, granularity, axis=-1, **kwargs), quantize(x, granularity, axis=0, **kwargs)
    _check_arguments(x, granularity, dtype, 0, power_2_scales, amax_epsilon, None, mx_scale_rule)
    if power_2_scales is None:
        power_2_scales = granularity.default_power_2_scales
    x2d = x.reshape(view_2d_shape(x.shape)).contiguous()
    fmt = format_of(dtype)
    rule = _kernel_scale_rule(granularity, fmt, x.dtype, power_2_scales, amax_epsilon, mx_scale_rule)
    last, first = kernels.quantize_both_usages(x2d, granularity.along, fmt, rule)
    return tuple(
        _assemble(x, codes.view(dtype), scale_inv, granularity, axis, power_2_scales)
        for axis, (codes, scale_inv) in ((-1, last), (0, first))
    )
