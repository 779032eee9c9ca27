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

import torch

from ..spec.granularities import view_2d_shape
from ..spec.rule import QuantRule
from .e2m1 import cast_to_e2m1, pack_e2m1
from .hadamard import random_hadamard_transform
from .scaling import exp2_int, mx_scale_exponent, nvfp4_block_scales
from .tensor import QuantizedTensor

__all__ = ["quantize_fp4"]

_E2M1_MAX = 6.0


def _amax(x: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """``max |x|`` over ``dims`` (kept; ``None``: all, as a scalar) in float32; NaN
    propagates; 0 for an empty tensor."""
    if x.numel() == 0:
        shape = () if dims is None else tuple(1 if d in dims else n for d, n in enumerate(x.shape))
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    magnitude = x.abs().to(torch.float32)
    return magnitude.amax() if dims is None else magnitude.amax(dim=dims, keepdim=True)


def _mx_scales(group_amax: torch.Tensor, rule: QuantRule) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4's ``(scale, E8M0 exponent bits)``: the MXFP8 rule with 6 for 448."""
    exponent = mx_scale_exponent(group_amax, rule.fp8_max, rule.mx_scale_rule)
    scale = exp2_int(127 - exponent.to(torch.int32))
    # A NaN block's scale is NaN (0xFF); its values become code 0 (E2M1 has no NaN).
    scale = torch.where(exponent == 0xFF, torch.full_like(scale, float("nan")), scale)
    return scale, exponent


def _codes(x_groups: torch.Tensor, enc: torch.Tensor, rule: QuantRule, generator) -> torch.Tensor:
    """E2M1 codes of ``clamp(x * enc, -6, 6)`` (float32 product), one a byte."""
    scaled = x_groups.to(torch.float32) * enc
    return cast_to_e2m1(
        scaled.clamp(-_E2M1_MAX, _E2M1_MAX), stochastic_rounding=rule.stochastic_rounding, generator=generator
    )


def quantize_fp4(
    x: torch.Tensor,
    rule: QuantRule,
    axis: int,
    scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    global_amax: torch.Tensor | None = None,
) -> QuantizedTensor:
    """``x`` (checked by :func:`fp8train.quant.quantize.quantize`; ``axis`` normalized) in 4
    bits by ``rule``: the transform (``rule.rht``), the scales, the E2M1 cast (stochastic
    with ``rule.stochastic_rounding``, drawing from ``generator``), the packing. NVFP4's
    global scales come from ``global_amax`` (a float32 scalar on ``x``'s device: the whole
    tensor's, of which ``x`` is a shard) where given, else from ``x``'s own amax (after the
    transform). (``scale``: the door's uniform signature; 4-bit rules take none.)"""
    granularity = rule.granularity
    if rule.rht:
        x = random_hadamard_transform(x, axis)
    m, k = view_2d_shape(x.shape)
    rows, cols = granularity.group_shape(axis, (m, k))
    x_groups = x.reshape(m // rows, rows, k // cols, cols)
    group_amax = _amax(x_groups, (1, 3))
    if granularity.two_level_scales:
        global_amax = _amax(x) if global_amax is None else global_amax
        scale_inv, enc = nvfp4_block_scales(group_amax, global_amax)
    else:
        enc, scale_inv = _mx_scales(group_amax, rule)
        if not torch.compiler.is_compiling():
            scale_inv = scale_inv.view(torch.float8_e8m0fnu)
    codes = _codes(x_groups, enc, rule, generator).reshape(m, k)
    if axis == -1:
        data = pack_e2m1(codes, -1).reshape(*x.shape[:-1], k // 2)
    else:
        data = pack_e2m1(codes, 0)
    return QuantizedTensor(
        data=data,
        scale_inv=scale_inv.reshape(m // rows, k // cols),
        granularity=granularity,
        axis=axis,
        power_2_scales=granularity.always_power_2,
        global_amax=global_amax,
    )
