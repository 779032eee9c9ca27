"""The 4-bit family's CPU kernel, compiled by numba: bit-identical to the reference path of
:mod:`fp8train.quant.fp4_quantize` for every 4-bit rule: ``nvfp4`` (1x16) and ``mxfp4``
(1x32) along either axis, ``nvfp4_2d`` (16x16 tiles), each rounded to nearest even or
stochastically, and ``nvfp4`` with the random Hadamard transform along either axis.

NVFP4 takes two reads: the tensor's amax (the FP8 kernels' ``max_magnitude``; with the
transform, the amax of the transformed values, computed and not stored), whose global scales
come from the reference's own ``nvfp4_global_scales``; then per group the (transformed)
values' amax, the E4M3 block scale and the E2M1 cast. MXFP4 takes one. Stochastic rounding
draws the reference's very ``torch.rand`` tensor (one float32 draw per value, from the same
generator) and hands it to the kernel, so the bits and the generator's state both match.

:func:`quantize` is what the 4-bit family's door (:mod:`fp8train.quant.quantize`) calls for
a tensor :func:`.launch.kernels_usable` takes; it declines (``None``) an NVFP4 tensor whose
(transformed) amax is NaN, which the reference path then quantizes. The functions below it
lay out the arguments and launch :mod:`.numba_fp4` and :mod:`.numba_fp4_transform`.
"""

from __future__ import annotations

import functools

import torch

from ...spec.formats import E4M3
from ...spec.granularities import view_2d_shape
from ...spec.rule import QuantRule
from ..scaling import nvfp4_global_scales
from ..tensor import QuantizedTensor, quantized_tensor
from .fp8 import tensor_amax
from .fp8_rule import cast_encoding, rule_scale_args
from .launch import BITS_LIKE, KERNEL_LAUNCH, STRIPE_BYTES, float32_scalar, kernel_input

__all__ = ["quantize", "quantize_fp4_blocks", "transformed_amax"]


def quantize(
    x: torch.Tensor,
    rule: QuantRule,
    axis: int,
    scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    global_amax: torch.Tensor | None = None,
) -> QuantizedTensor | None:
    """``x`` quantized by the 4-bit ``rule`` along ``axis`` (normalized: -1 or 0), as
    :func:`fp8train.quant.fp4_quantize.quantize_fp4` computes it, NVFP4 under ``global_amax``
    (float32 scalar) where given, else ``x``'s own (after the transform); ``None`` where the
    reference must decide the bits (a NaN amax). Stochastic rounding draws from ``generator``
    (``None``: PyTorch's default) exactly what the reference path draws, so the generator
    ends in the same state. (``scale``: the door's uniform signature; 4-bit rules take none.)"""
    granularity = rule.granularity
    x2d = x.detach().reshape(view_2d_shape(x.shape)).contiguous()
    if granularity.two_level_scales:
        if global_amax is None:
            global_amax = transformed_amax(x2d, axis) if rule.rht else tensor_amax(x2d)
        if bool(global_amax.isnan()):
            # Every NVFP4 scale is then NaN, and which NaN code (0x7F or 0xFF) the reference
            # stores depends on PyTorch's vector path: the reference path decides it (and draws).
            return None
    draws = None
    if rule.stochastic_rounding:
        # The reference's draws (e2m1._round_stochastically): one torch.rand over its groups
        # view, from the same generator, after the same (draw-free) steps.
        m, k = x2d.shape
        rows, cols = granularity.group_shape(axis, (m, k))
        draws = torch.rand((m // rows, rows, k // cols, cols), generator=generator, dtype=torch.float32)
        draws = draws.reshape(m, k)
    return _quantized_tensor(x, rule, axis, *quantize_fp4_blocks(x2d, rule, axis, global_amax, draws))


def _quantized_tensor(x: torch.Tensor, rule: QuantRule, axis: int, data, scales, global_amax) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of :func:`quantize_fp4_blocks`'s output (``axis=-1``:
    data keeps ``x``'s leading dims; ``axis=0``: the 2-D view's)."""
    granularity = rule.granularity
    scale_dtype = torch.float8_e8m0fnu if granularity.e8m0_scales else torch.float8_e4m3fn
    data = data.view(torch.float4_e2m1fn_x2)
    data = data.reshape(*x.shape[:-1], x.shape[-1] // 2) if axis == -1 else data
    return quantized_tensor(data, scales.view(scale_dtype), granularity, axis, granularity.always_power_2, global_amax)


@functools.cache
def _e4m3_values():
    """The float32 value of every E4M3 code (0x7F and 0xFF: NaN), as a NumPy array."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()


@functools.cache
def _compiled():
    """The compiled 4-bit kernels, and the transform's (numba imports: :func:`.launch.kernels_usable` said so)."""
    from . import numba_fp4, numba_fp4_transform

    return numba_fp4, numba_fp4_transform


def transformed_amax(x2d: torch.Tensor, axis: int) -> torch.Tensor:
    """``max |rht(x2d)|`` along ``axis`` (the transform rounded to ``x2d``'s dtype) as a float32
    scalar tensor, NaN if any transformed value is NaN; the transform is not stored."""
    import numpy as np

    source = kernel_input(x2d)
    (m, k), args = source.shape, (source.data_ptr(), BITS_LIKE[source.dtype])
    with KERNEL_LAUNCH:
        transform = _compiled()[1]
        if axis == -1:
            bits = transform.rht_peak_runs_at(*args, m, k, _ROUND_TO[x2d.dtype])
        else:
            bits = transform.rht_peak_columns_at(*args, m, k, _width(source), _ROUND_TO[x2d.dtype])
    return torch.tensor(float(np.uint32(bits).view(np.float32)), dtype=torch.float32)


def quantize_fp4_blocks(
    x2d: torch.Tensor,
    rule: QuantRule,
    axis: int,
    global_amax: torch.Tensor | None,
    draws: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize the contiguous 2-D ``x2d`` (M, K) by the 4-bit ``rule`` along ``axis`` (-1: one
    row by the block, or 16x16 tiles for ``nvfp4_2d``; 0: the block by one column), after the
    transform with ``rule.rht``; NVFP4 under the scales of the float32 ``global_amax`` (not
    NaN), MXFP4 (``None``); stochastically with ``draws`` (float32 (M, K): one uniform draw per
    value), else to nearest even.

    Returns:
        ``(data, scales, global_amax)``: uint8 E2M1 codes two a byte along ``axis``, (M, K/2)
        or (M/2, K); the stored scales' uint8 bits (E4M3 for NVFP4, E8M0 for MXFP4), one per
        group (M, K/block), (M/block, K) or (M/16, K/16); NVFP4's float32 global amax as given.
    """
    m, k = x2d.shape
    rows, cols = rule.granularity.group_shape(axis, (m, k))
    data = torch.empty((m, k // 2) if axis == -1 else (m // 2, k), dtype=torch.uint8)
    scales = torch.empty((m // rows, k // cols), dtype=torch.uint8)
    scale = (*_global_args(global_amax), rule_scale_args(rule, torch.float32), cast_encoding(E4M3), _e4m3_values())
    stochastic = draws is not None
    source = kernel_input(x2d)
    # The draws are read only with stochastic (then (M, K) float32, contiguous: the door's).
    tensors = (source.data_ptr(), BITS_LIKE[source.dtype], m, k, data.data_ptr(), scales.data_ptr(), draws.data_ptr() if stochastic else 0)
    round_to = _ROUND_TO[x2d.dtype]
    with KERNEL_LAUNCH:
        kernels, transform = _compiled()
        if rule.rht and axis == -1:
            transform.quantize_rht_runs_at(*tensors, round_to, *scale, stochastic)
        elif rule.rht:
            transform.quantize_rht_columns_at(*tensors, _width(source), round_to, *scale, stochastic)
        elif rows > 1 and cols > 1:
            kernels.quantize_fp4_tiles_at(*tensors, cols, _width(source, cols), *scale, stochastic)
        elif axis == -1:
            kernels.quantize_fp4_groups_at(*tensors, cols, *scale, stochastic)
        else:
            kernels.quantize_fp4_columns_at(*tensors, rows, _width(source, rows), *scale, stochastic)
    return data, scales, global_amax


_ROUND_TO = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""How the transform's kernels round a transformed value: to the input's dtype."""


def _width(source: torch.Tensor, rows: int = 16) -> int:
    """Columns one task of a striped kernel takes (``rows`` rows): about :data:`STRIPE_BYTES`
    of input, a multiple of 16 (whole 16x16 tiles), at least 16, at most all."""
    k = source.shape[1]
    return min(k, max(16, STRIPE_BYTES // (rows * source.element_size()) // 16 * 16))


def _global_args(global_amax: torch.Tensor | None) -> tuple:
    """``(nvfp4, ge / 6, gd)`` as the kernels take them, from ``nvfp4_global_scales`` itself."""
    if global_amax is None:
        return False, float32_scalar(1.0), float32_scalar(1.0)
    ge, gd = nvfp4_global_scales(global_amax)
    ge_over_6 = ge * torch.tensor(1.0 / 6.0, dtype=torch.float32)
    return True, float32_scalar(ge_over_6.item()), float32_scalar(gd.item())
