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

import functools
import math
from typing import NamedTuple

import torch

from ..spec.granularities import Granularity, view_2d_shape
from ..spec.hash_once import MEMO_PREFIX
from ..spec.rule import QuantRule
from .cast import CHUNK_ELEMENTS, DIRECT_ELEMENTS, DTYPE_BY_NAME, checked_fp8_to_hp, e8m0_float32_bits
from .constants import ConstantMemo
from .scaling import (
    FLOAT32_MAX,
    SCALE_CONSTANTS,
    ScaleConstants,
    ceil_e8m0_exponent,
    checked_amax_to_scale,
    mx_scale_exponent,
)
from .tensor import QuantizedTensor, quantized_tensor

__all__ = ["quantize_fp8", "quantize_fp8_usages", "operand_values", "fp8_tensor", "group_amax", "group_scales", "e8m0_group_scales", "amax_over", "reciprocal"]


def amax_over(x_view: torch.Tensor, dims: tuple[int, ...] | None) -> torch.Tensor:
    """``max |x|`` over ``dims`` of a non-empty view (kept; ``None``: all, 0-dim), in ``x``'s
    dtype (exact: a magnitude of ``x``). NaN propagates."""
    if dims is None:
        low, high = torch.aminmax(x_view)
        return torch.maximum(-low, high)
    # max |x| in one pass with no |x| temporary: one GPU launch, and on CPU as fast as abs
    # then amax or faster.
    return torch.linalg.vector_norm(x_view, math.inf, dim=dims, keepdim=True)


def group_amax(x_groups: torch.Tensor) -> torch.Tensor:
    """``max |x|`` per group of a ``(row groups, rows, col groups, cols)`` view, in ``x``'s
    dtype (exact: a magnitude of ``x``), keeping all four dims. NaN propagates; an empty
    group gives 0."""
    num_row_groups, rows, num_col_groups, cols = x_groups.shape
    if x_groups.numel() == 0:
        return x_groups.new_zeros(num_row_groups, 1, num_col_groups, 1)
    if num_row_groups == num_col_groups == 1:
        return amax_over(x_groups, None).reshape(1, 1, 1, 1)
    return amax_over(x_groups, (1, 3))


def group_scales(amax, rule: QuantRule, x_dtype, divide_in: torch.dtype = torch.float32, constants=None):
    """``(scale, scale_inv)`` of every group from its amax. E8M0 scales come back as their
    uint8 exponent bits in ``scale_inv``. ``divide_in``: the dtype of the divisions (the
    quotient and the reciprocal), as :func:`~fp8train.quant.scaling.amax_to_scale` takes it:
    float64 gives the same bits where float32 division is not correctly rounded.
    ``constants``: the :class:`~fp8train.quant.scaling.ScaleConstants` of the rule's format
    on ``amax``'s device, where the caller has them (the same bits in fewer calls; the scales
    then broadcast: a 0-dim ``amax`` gives ``[1]``)."""
    granularity = rule.granularity
    if granularity.e8m0_scales:
        return e8m0_group_scales(amax, rule, constants)
    # Block scales that overflow take the input dtype's largest value (NUMERICS.md).
    inf_scale_value = torch.finfo(x_dtype).max if granularity.block else FLOAT32_MAX
    fp8_max, numerator = (rule.fp8_max, None) if constants is None else (constants.fp8_max, constants.numerator)
    # The rule's fields were checked when it was built, and amax is this quantization's own.
    scale = checked_amax_to_scale(
        amax, fp8_max, rule.power_2_scales, rule.amax_epsilon, inf_scale_value, divide_in, numerator
    )
    return scale, torch.reciprocal(scale) if divide_in == torch.float32 else reciprocal(scale, divide_in)


def e8m0_group_scales(amax, rule: QuantRule, constants: ScaleConstants | None):
    """:func:`group_scales` of E8M0 scales (``rule``'s granularity has them): the float32 scale
    and the exponent bits."""
    amax = amax if amax.dtype == torch.float32 else amax.to(torch.float32)
    if rule.amax_epsilon > 0:
        amax = torch.where(amax < rule.amax_epsilon, torch.full_like(amax, rule.amax_epsilon), amax)
    if constants is None or rule.mx_scale_rule != "ceil":
        exponent = mx_scale_exponent(amax, rule.fp8_max, rule.mx_scale_rule).to(torch.int32)
    else:  # mx_scale_exponent's "ceil" with its reciprocal built once
        exponent = ceil_e8m0_exponent(amax * constants.mx_reciprocal)
    # The scale 2^(127 - e) is the E8M0 value of code 254 - e: 2^-127 (a subnormal) for e = 254
    # (an infinite amax), and for e = 0xFF (a NaN anywhere in the block) code 0xFF, NaN: the
    # whole block NaN.
    scale = e8m0_float32_bits((-exponent + 254) & 0xFF).view(torch.float32)
    return scale, exponent.to(torch.uint8)


def reciprocal(scale: torch.Tensor, divide_in: torch.dtype = torch.float32) -> torch.Tensor:
    """``1 / scale`` as float32 (one op in float32; float64 gives the same bits)."""
    if divide_in == torch.float32:
        return torch.reciprocal(scale)
    return torch.reciprocal(scale.to(divide_in)).to(torch.float32)


class _Plan(NamedTuple):
    """What a quantization by one rule along one axis of one shape on one device needs besides
    the tensor, derived once (:data:`_PLANS`; issue 38: no shape arithmetic, no property
    chain, no constant built on each call).

    Attributes:
        view_shape: the view of ``x`` the groups are read in: ``x``'s own shape for one scale
            per tensor, the 2-D view for whole rows or columns (``row``), else
            ``(row groups, rows, col groups, cols)``.
        amax_dims: the dims of that view each group's amax runs over (``None``: all of them).
        keepdim: whether the amax keeps those dims: all but blocks, whose amaxes (and so
            scales) come out compact, ``scale_shape``, and broadcast over the view by
            :data:`_BLOCKS` (an index: no reshape call, issue 38).
        amax_shape: the shape of the amaxes (the shape of an empty tensor's zeros).
        scale_shape: the compact ``scale_inv`` layout (:class:`QuantizedTensor`'s).
        numel: the elements of ``x``.
        dtype: the FP8 data dtype.
        constants: the scale rules' constants of the rule's format on the device.
    """

    view_shape: tuple[int, ...]
    amax_dims: tuple[int, ...] | None
    keepdim: bool
    amax_shape: tuple[int, ...]
    scale_shape: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    constants: ScaleConstants


def _build_plan(rule: QuantRule, axis: int, shape: torch.Size, device: torch.device, traced: bool = False) -> _Plan:
    granularity = rule.granularity
    m, k = view_2d_shape(shape)
    rows, cols = granularity.group_shape(axis, (m, k))
    scale_shape = (m // rows if rows else 1, k // cols if cols else 1)
    if granularity.per_tensor:
        view_shape, amax_dims, amax_shape, scale_shape = tuple(shape), None, (), ()
    elif granularity.k_uniform:  # a group is a whole row (axis -1) or column (axis 0)
        view_shape, amax_dims, amax_shape = (m, k), ((1,) if axis == -1 else (0,)), scale_shape
    else:
        view_shape = (scale_shape[0], rows, scale_shape[1], cols)
        amax_dims, amax_shape = (1, 3), (scale_shape[0], 1, scale_shape[1], 1)
    fp8_max = rule.fp8_max
    constants = SCALE_CONSTANTS.build(fp8_max, device) if traced else SCALE_CONSTANTS[fp8_max, device]
    dtype = DTYPE_BY_NAME[rule.format.dtype_name]  # the rule's format is checked: no torch_dtype
    keepdim = granularity.per_tensor or granularity.k_uniform
    return _Plan(view_shape, amax_dims, keepdim, amax_shape, scale_shape, m * k, dtype, constants)


_BLOCKS = (slice(None), None, slice(None), None)
"""The index that spreads compact block scales ``[row groups, col groups]`` over the view
``(row groups, rows, col groups, cols)`` (a plan's ``keepdim=False``)."""


_PLANS_KEY = MEMO_PREFIX + "fp8_plans"
"""Where a rule keeps its :class:`_Plan` memo (a :class:`ConstantMemo` keyed by ``(axis,
shape, device)``), read with subscripts: a lookup hashes no rule, so makes no Python call
(issue 38; a rule's ``hash_once`` and ``__eq__`` are calls)."""


def _memo_plan(rule: QuantRule, axis: int, shape: torch.Size, device: torch.device) -> _Plan:
    """The :class:`_Plan` from ``rule``'s memo, the memo made at the rule's first quantization."""
    memo = rule.__dict__.get(_PLANS_KEY)
    if memo is None:
        memo = rule.__dict__[_PLANS_KEY] = ConstantMemo(functools.partial(_build_plan, rule))
    return memo[axis, shape, device]


def quantize_fp8(
    x: torch.Tensor, rule: QuantRule, axis: int, scale: torch.Tensor | None, generator=None, global_amax=None,
    *, traced: bool | None = None, values: torch.dtype | None = None,
) -> QuantizedTensor:
    """``x`` (checked by :func:`fp8train.quant.quantize.quantize`; ``axis`` normalized)
    quantized by the FP8 ``rule`` along ``axis``, one scale per scaling group (``scale``: a
    given per-tensor scale). (``generator`` and ``global_amax``: the door's uniform
    signature; FP8 rules use neither. ``traced``: whether ``torch.compile`` traces this,
    where the caller knows: ``False`` for a layer's bound kernels; ``None`` asks.)

    ``values`` (float32 or bfloat16): also keep, in the result's ``gemm_cache``, the
    emulated GEMM's operand (:func:`operand_values`), for a bound layer's call on the CPU
    that multiplies it at once (issue 38: none of the GEMM's own calls)."""
    if traced is None:
        traced = torch.compiler.is_compiling()
    if traced:
        plan = _build_plan(rule, axis, x.shape, x.device, True)
    else:
        try:  # the rule's own memo, read with subscripts: no call (issue 38)
            plan = rule.__dict__[_PLANS_KEY][axis, x.shape, x.device]
        except KeyError:
            plan = _memo_plan(rule, axis, x.shape, x.device)
    x_view = x if x.shape == plan.view_shape else x.reshape(plan.view_shape)
    granularity, fp8_max = rule.granularity, plan.constants.fp8_max
    if scale is not None:
        scale, scale_inv, power_2 = _given_scale(x, scale)
    elif granularity.e8m0_scales or plan.amax_dims is None or plan.numel == 0:
        scale, scale_inv = _computed_scales(x_view, rule, plan, x.dtype)
        power_2 = rule.power_2_scales
    else:  # _computed_scales' amax of groups and group_scales, without their calls (issue 38)
        amax = torch.linalg.vector_norm(x_view, math.inf, dim=plan.amax_dims, keepdim=plan.keepdim)
        inf_scale_value = torch.finfo(x.dtype).max if granularity.block else FLOAT32_MAX
        scale = checked_amax_to_scale(
            amax, fp8_max, rule.power_2_scales, rule.amax_epsilon, inf_scale_value, torch.float32,
            plan.constants.numerator,
        )
        scale_inv, power_2 = torch.reciprocal(scale), rule.power_2_scales
        scale = scale if plan.keepdim else scale[_BLOCKS]
    power_2 = granularity.always_power_2 or power_2
    if not (traced or plan.numel <= CHUNK_ELEMENTS or x.device.type != "cpu"):
        data = _chunked_scaled_codes(x_view, scale, plan, power_2)
    elif x.dtype == torch.float32:  # _scaled_codes of a float32 x, without its call
        data = (x_view * scale).clamp_(-fp8_max, fp8_max).to(plan.dtype)
    else:
        data = _scaled_codes(x_view, scale, plan, power_2, convert_first=False)
    if granularity.e8m0_scales:
        qt = fp8_tensor(x, data, scale_inv, granularity, axis, power_2, None, traced, plan.scale_shape)
    else:  # fp8_tensor, without its call or its shape arithmetic (issue 38)
        qt = quantized_tensor(
            data if x.shape == plan.view_shape else data.reshape(x.shape),
            scale_inv if scale_inv.shape == plan.scale_shape else scale_inv.reshape(plan.scale_shape),
            granularity, axis, power_2, None, not traced,
        )
    if values is not None:
        cache = qt.gemm_cache  # the emulated GEMM's operand, as it would keep it
        cache.values, cache.out_scale = operand_values(qt, data, scale_inv, plan, values)
        cache.compute_dtype = values
    return qt


def _given_scale(x: torch.Tensor, scale: torch.Tensor):
    """``(scale, scale_inv, computed power_2)`` of a given per-tensor scale: ``[1]``, so that a
    16-bit x is promoted (see :func:`_scaled_codes`)."""
    if scale.dtype != torch.float32 or scale.device != x.device:
        scale = scale.to(device=x.device, dtype=torch.float32)
    return scale.reshape(1), torch.reciprocal(scale), False


def quantize_fp8_usages(
    x: torch.Tensor, rule: QuantRule, scale: torch.Tensor | None = None, values: tuple | None = None
) -> tuple[QuantizedTensor, QuantizedTensor] | None:
    """Both usages of ``x`` by ``rule``, axis -1 then axis 0 (the two :func:`quantize_fp8`
    calls' bits), in one call, for a caller outside ``torch.compile`` with both to make (a
    layer's bound reference path: issue 38, one call where a role's two were three). The
    reference's two passes still: no one read. ``None`` for a symmetric granularity, whose
    first-dim usage is the last-dim one transposed. ``values``: each usage's operand dtype
    or ``None``, as :func:`quantize_fp8`'s (``None``: neither)."""
    if rule.granularity.symmetric:
        return None
    last_values, first_values = (None, None) if values is None else values
    last = quantize_fp8(x, rule, -1, scale, traced=False, values=last_values)
    return last, quantize_fp8(x, rule, 0, scale, traced=False, values=first_values)


def _computed_scales(x_view: torch.Tensor, rule: QuantRule, plan: _Plan, x_dtype: torch.dtype):
    """``(scale, scale_inv)`` of every group of ``x_view`` from its amax (:func:`group_scales`
    with the plan's constants; E8M0 scale_inv as its uint8 bits)."""
    amax = x_view.new_zeros(plan.amax_shape) if plan.numel == 0 else amax_over(x_view, plan.amax_dims)
    if rule.granularity.e8m0_scales:  # group_scales' first branch, without its call
        return e8m0_group_scales(amax, rule, plan.constants)
    return group_scales(amax, rule, x_dtype, constants=plan.constants)


def operand_values(qt: QuantizedTensor, data: torch.Tensor, scale_inv: torch.Tensor, plan: _Plan, dtype: torch.dtype):
    """``(values, out_scale)``: the emulated GEMM's operand of ``qt`` in ``dtype``, from its
    codes and groups' ``scale_inv`` as the quantization made them (in the plan's view and the
    amax's shape, or compact where the plan's amax keeps no dims; E8M0 as uint8 bits), by the ops of
    :func:`fp8train.quant.gemm.emulated._operand` (so the same bits): the codes' exact values
    times power-of-two scales, or bare values and the per-tensor scale the GEMM applies to
    its output."""
    if plan.numel <= DIRECT_ELEMENTS:  # checked_fp8_to_hp's own choice, without its call
        values = data.to(torch.float32)
        values = values if dtype == torch.float32 else values.to(dtype)
    else:
        values = checked_fp8_to_hp(data, dtype, False, None if plan.keepdim else plan.numel)  # blocks: 4-D codes
    if not qt.power_2_scales:
        if not qt.granularity.per_tensor:
            raise ValueError(f"{qt.granularity} scales that are not powers of two do not fold into a GEMM operand")
        return values if values.shape == qt.data.shape else values.reshape(qt.data.shape), qt.scale_inv
    if scale_inv.dtype == torch.uint8:  # E8M0 bits: the GEMM's decoding (_scales_in)
        scale_inv = e8m0_float32_bits(scale_inv.to(torch.int32)).view(torch.float32)
    scale_inv = scale_inv if scale_inv.dtype == dtype else scale_inv.to(dtype)
    if not plan.keepdim and scale_inv.shape == plan.scale_shape:  # compact block scales
        scale_inv = scale_inv[_BLOCKS]
    values = values * scale_inv
    return values if values.shape == qt.data.shape else values.reshape(qt.data.shape), None


def _scaled_codes(x_part, scale_part, plan: _Plan, scales_are_powers_of_2: bool, convert_first: bool):
    """``cast_to_fp8(x_part * scale_part)`` with the product rounded as float32 would round it
    (``convert_first``: a chunk's, converted to float32 before the product)."""
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
    # cast_scratch_to_fp8 of this call's own product, without its checks (x checked by the
    # door, the dtype the checked rule's): clamped in place to +-max, then cast.
    fp8_max = plan.constants.fp8_max
    return scaled.clamp_(-fp8_max, fp8_max).to(plan.dtype)


def _chunked_scaled_codes(x_view: torch.Tensor, scale: torch.Tensor, plan: _Plan, powers_of_2: bool):
    """:func:`_scaled_codes` of a large CPU view, in chunks of whole row groups (or rows), so
    the scaled intermediate never has to be allocated, and paged in, at full size."""
    # Chunk along the first dim when it has several indices, else along the second (the
    # first's one index: one row group); the scale follows where it varies along that dim.
    dim = 0 if x_view.shape[0] > 1 else 1
    step = max(1, CHUNK_ELEMENTS // (plan.numel // x_view.shape[dim]))
    scale_varies = scale.ndim > dim and scale.shape[dim] > 1
    out = torch.empty(x_view.shape, dtype=plan.dtype)
    for start in range(0, x_view.shape[dim], step):
        part = (slice(start, start + step),) if dim == 0 else (slice(None), slice(start, start + step))
        scale_part = scale[part] if scale_varies else scale
        out[part] = _scaled_codes(x_view[part], scale_part, plan, powers_of_2, convert_first=True)
    return out


def fp8_tensor(
    x, data, scale_inv, granularity: Granularity, axis: int, computed_power_2: bool, shape_2d=None, traced=None,
    scale_shape=None,
) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of ``x`` from its codes and its groups' ``scale_inv``
    (``shape_2d``: ``x``'s 2-D view where the caller has it already; ``traced``: whether
    ``torch.compile`` traces this, where the caller knows, ``None`` asks; ``scale_shape``:
    the compact ``scale_inv`` shape where the caller has it)."""
    if traced is None:
        traced = torch.compiler.is_compiling()
    if scale_shape is None and granularity.per_tensor:
        scale_shape = ()
    elif scale_shape is None:
        m, k = view_2d_shape(x.shape) if shape_2d is None else shape_2d
        rows, cols = granularity.group_shape(axis, (m, k))
        scale_shape = (m // rows if rows else 1, k // cols if cols else 1)
    scale_inv = scale_inv if scale_inv.shape == scale_shape else scale_inv.reshape(scale_shape)
    if granularity.e8m0_scales and not traced:
        # Inside torch.compile the scales stay as their uint8 bits: inductor (torch 2.13)
        # has no E8M0 kernels, and every reader here takes either dtype.
        scale_inv = scale_inv.view(torch.float8_e8m0fnu)
    data = data if data.shape == x.shape else data.reshape(x.shape)
    power_2 = granularity.always_power_2 or computed_power_2
    return quantized_tensor(data, scale_inv, granularity, axis, power_2, None, not traced)
