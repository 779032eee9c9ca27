"""4-bit quantization (NUMERICS.md 6): NVFP4 (1x16 groups or 16x16 tiles, E4M3 block scales
under a float32 global scale) and MXFP4 (1x32 groups, E8M0 scales), E2M1 data packed two
values a byte along the scaling axis. The reference path, in PyTorch ops on any device: the
4-bit family's door (:func:`fp8train.quant.quantize.quantize`) calls :func:`quantize_fp4`
where no kernel takes the tensor, or where the kernel declines it.

Layouts for an input whose 2-D view is ``[M, K]``:

============  ===============================  ==================================
              ``axis=-1`` (rowwise)             ``axis=0`` (columnwise)
============  ===============================  ==================================
data          ``[..., K/2]`` (leading dims kept)  ``[M/2, K]`` (the 2-D view)
nvfp4         scales ``[M, K/16]`` E4M3           ``[M/16, K]`` E4M3
nvfp4_2d      scales ``[M/16, K/16]`` E4M3, data ``[..., K/2]`` (axis ignored: always -1)
mxfp4         scales ``[M, K/32]`` E8M0           ``[M/32, K]`` E8M0
============  ===============================  ==================================
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..spec.granularities import view_2d_shape
from ..spec.rule import QuantRule
from .constants import ConstantMemo
from .e2m1 import E2M1Constants, e2m1_codes, e2m1_constants, pack_codes
from .fp8_quantize import amax_over, e8m0_group_scales
from .hadamard import hadamard_transform, rht_matrix
from .scaling import SCALE_CONSTANTS, ScaleConstants, nvfp4_block_scales
from .tensor import QuantizedTensor, quantized_tensor

__all__ = ["quantize_fp4"]

_E2M1_MAX = 6.0


class _Plan(NamedTuple):
    """What a 4-bit quantization by one rule along one axis of one shape on one device needs
    besides the tensor, derived once (:data:`_PLANS`; issue 38).

    Attributes:
        view_shape: ``(row groups, rows, col groups, cols)``, the groups' view of the 2-D view.
        shape_2d: the 2-D view ``(M, K)``.
        data_shape: the packed data's shape (module docstring).
        scale_shape: the compact ``scale_inv`` layout.
        numel: the elements of ``x``.
        constants: the scale rules' constants of E2M1 on the device.
        e2m1: E2M1's constants on the device.
        hadamard: the transform's matrix on the device (``rule.rht``), else ``None``.
    """

    view_shape: tuple[int, int, int, int]
    shape_2d: tuple[int, int]
    data_shape: tuple[int, ...]
    scale_shape: tuple[int, int]
    numel: int
    constants: ScaleConstants
    e2m1: E2M1Constants
    hadamard: torch.Tensor | None


def _build_plan(rule: QuantRule, axis: int, shape: torch.Size, device: torch.device, traced: bool = False) -> _Plan:
    m, k = view_2d_shape(shape)
    rows, cols = rule.granularity.group_shape(axis, (m, k))
    data_shape = (*shape[:-1], k // 2) if axis == -1 else (m // 2, k)
    constants = SCALE_CONSTANTS.build(rule.fp8_max, device) if traced else SCALE_CONSTANTS[rule.fp8_max, device]
    hadamard = rht_matrix(device) if rule.rht else None
    return _Plan(
        (m // rows, rows, k // cols, cols), (m, k), data_shape, (m // rows, k // cols), m * k, constants,
        e2m1_constants(device, traced), hadamard,
    )


_PLANS = ConstantMemo(_build_plan)
"""``_PLANS[rule, axis, shape, device]``: the :class:`_Plan` of a 4-bit quantization."""


def quantize_fp4(
    x: torch.Tensor,
    rule: QuantRule,
    axis: int,
    scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    global_amax: torch.Tensor | None = None,
    *,
    traced: bool | None = None,
) -> QuantizedTensor:
    """``x`` (checked by :func:`fp8train.quant.quantize.quantize`; ``axis`` normalized) in 4
    bits by ``rule``: the transform (``rule.rht``), the scales, the E2M1 cast (stochastic
    with ``rule.stochastic_rounding``, drawing from ``generator``), the packing. NVFP4's
    global scales come from ``global_amax`` (a float32 scalar on ``x``'s device: the whole
    tensor's, of which ``x`` is a shard) where given, else from ``x``'s own amax (after the
    transform). (``scale``: the door's uniform signature; 4-bit rules take none.
    ``traced``: whether ``torch.compile`` traces this, where the caller knows; ``None`` asks.)"""
    if traced is None:
        traced = torch.compiler.is_compiling()
    plan = _build_plan(rule, axis, x.shape, x.device, True) if traced else _PLANS[rule, axis, x.shape, x.device]
    granularity = rule.granularity
    if rule.rht:
        x = hadamard_transform(x, axis, plan.hadamard)
    x_groups = x.reshape(plan.view_shape)
    if granularity.two_level_scales:
        magnitude = x_groups.abs()
        magnitude = magnitude if magnitude.dtype == torch.float32 else magnitude.to(torch.float32)
        group_amax = magnitude.amax(dim=(1, 3), keepdim=True)
        if global_amax is None:  # x's own (0 for an empty x, whose amax() would raise)
            global_amax = magnitude.amax() if plan.numel else torch.zeros((), dtype=torch.float32, device=x.device)
        scale_inv, enc = nvfp4_block_scales(group_amax, global_amax, plan.constants)
    else:
        # The E8M0 exponent of a NaN block is 0xFF whichever NaN its amax is: the norm's amax.
        enc, scale_inv = e8m0_group_scales(amax_over(x_groups, (1, 3)), rule, plan.constants)
        scale_inv = scale_inv if traced else scale_inv.view(torch.float8_e8m0fnu)
    # E2M1 codes of clamp(x * enc, -6, 6), the product in float32.
    scaled = (x_groups if x_groups.dtype == torch.float32 else x_groups.to(torch.float32)) * enc
    codes = e2m1_codes(scaled.clamp_(-_E2M1_MAX, _E2M1_MAX), rule.stochastic_rounding, generator, plan.e2m1)
    data = pack_codes(codes.reshape(plan.shape_2d), axis)
    data = data if traced else data.view(torch.float4_e2m1fn_x2)
    data = data if data.shape == plan.data_shape else data.reshape(plan.data_shape)
    scale_inv = scale_inv.reshape(plan.scale_shape)
    return quantized_tensor(data, scale_inv, granularity, axis, granularity.always_power_2, global_amax, not traced)
