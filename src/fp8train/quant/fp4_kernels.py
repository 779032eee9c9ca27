"""Fused CPU 4-bit quantization, compiled by numba: bit-identical to the reference path of
:mod:`fp8train.quant.fp4_quantize`, for groups along the last dim (``nvfp4`` 1x16 and
``mxfp4`` 1x32, ``axis=-1``) with round to nearest even and no transform.

NVFP4 takes two reads: the tensor's amax (the FP8 kernels' ``max_magnitude``), whose global
scales are computed by the reference's own ``nvfp4_global_scales``; then per group of 16 the
amax, the E4M3 block scale and the E2M1 cast. MXFP4 takes one. Whether a tensor goes through
the kernel is :func:`fp8train.quant.kernels.kernels_usable`'s decision, as for the FP8 kernels;
:func:`try_quantize_fp4` returns ``None`` where the reference path must run (``rht``,
``stochastic_rounding``, ``axis=0``, ``nvfp4_2d``).
"""

from __future__ import annotations

import functools

import torch

from ..spec.formats import E4M3
from ..spec.granularities import view_2d_shape
from ..spec.rule import QuantRule
from .cast import HIGH_PRECISION_DTYPES
from .kernels import (
    STRIPE_BYTES,
    cast_encoding,
    float32_scalar,
    kernel_input,
    kernels_usable,
    launch_kernels,
    numpy_view,
    rule_scale_args,
    tensor_amax,
)
from .scaling import nvfp4_global_scales

__all__ = ["try_quantize_fp4", "quantize_fp4_blocks", "try_fp4_operand_values"]


def try_quantize_fp4(
    x: torch.Tensor, rule: QuantRule, axis: int, global_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(codes, scale bits, global_amax)`` of ``x`` by the 4-bit ``rule`` along ``axis``
    (normalized: -1 or 0), as :func:`quantize_fp4_blocks`, NVFP4 under ``global_amax``
    (float32 scalar) where given, else ``x``'s own; ``None`` where the kernel does not apply."""
    granularity = rule.granularity
    if not granularity.fp4 or granularity.across != 1 or rule.rht or rule.stochastic_rounding:
        return None
    if x.dtype not in HIGH_PRECISION_DTYPES or not kernels_usable(x):
        return None
    x2d = x.detach().reshape(view_2d_shape(x.shape)).contiguous()
    if granularity.two_level_scales and global_amax is None:
        global_amax = tensor_amax(x2d)
    if global_amax is not None and bool(global_amax.isnan()):
        # Every NVFP4 scale is then NaN, and which NaN code (0x7F or 0xFF) the reference
        # stores depends on PyTorch's vector path: the reference path decides it.
        return None
    return quantize_fp4_blocks(x2d, rule, axis, global_amax)


@functools.cache
def _e4m3_values():
    """The float32 value of every E4M3 code (0x7F and 0xFF: NaN), as a NumPy array."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()


@functools.cache
def _compiled_fp4():
    """The compiled 4-bit kernels (numba imports: :func:`kernels_usable` said so)."""
    from . import numba_fp4_kernels

    return numba_fp4_kernels


def quantize_fp4_blocks(
    x2d: torch.Tensor, rule: QuantRule, axis: int, global_amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize the contiguous 2-D ``x2d`` (M, K) in groups of ``rule``'s block along ``axis``
    (-1: one row by the block, 0: the block by one column); NVFP4 under the scales of the
    float32 ``global_amax`` (not NaN), MXFP4 (``None``).

    Returns:
        ``(data, scales, global_amax)``: uint8 E2M1 codes two a byte along ``axis``, (M, K/2)
        or (M/2, K); the stored scales' uint8 bits (E4M3 for NVFP4, E8M0 for MXFP4), (M,
        K/block) or (M/block, K); NVFP4's float32 global amax as given.
    """
    m, k = x2d.shape
    block = rule.granularity.along
    data = torch.empty((m, k // 2) if axis == -1 else (m // 2, k), dtype=torch.uint8)
    scales = torch.empty((m, k // block) if axis == -1 else (m // block, k), dtype=torch.uint8)
    source = kernel_input(x2d)
    scale_args = (*_global_args(global_amax), rule_scale_args(rule, torch.float32), cast_encoding(E4M3), _e4m3_values())
    with launch_kernels():
        if axis == -1:
            _compiled_fp4().quantize_fp4_groups(
                numpy_view(source, bits=True).reshape(-1),
                numpy_view(data).reshape(-1),
                numpy_view(scales).reshape(-1),
                block,
                *scale_args,
            )
        else:
            width = min(k, max(16, STRIPE_BYTES // (block * source.element_size())))
            _compiled_fp4().quantize_fp4_columns(
                numpy_view(source, bits=True), numpy_view(data), numpy_view(scales), block, width, *scale_args
            )
    return data, scales, global_amax


def _global_args(global_amax: torch.Tensor | None) -> tuple:
    """``(nvfp4, ge / 6, gd)`` as the kernels take them, from ``nvfp4_global_scales`` itself."""
    if global_amax is None:
        return False, float32_scalar(1.0), float32_scalar(1.0)
    ge, gd = nvfp4_global_scales(global_amax)
    ge_over_6 = ge * torch.tensor(1.0 / 6.0, dtype=torch.float32)
    return True, float32_scalar(ge_over_6.item()), float32_scalar(gd.item())


def try_fp4_operand_values(qt, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The K-last 4-bit operand ``qt``'s values times their block ``scales`` (float32
    ``[rows, K/block]``), ``[rows, K]`` of ``dtype`` (float32 or bfloat16), from one pass of
    :func:`fp8train.quant.numba_fp4_values.fold_fp4_values`; ``None`` where the kernels do not
    apply (:func:`fp8train.quant.kernels.kernels_usable`)."""
    data = qt.data.view(torch.uint8)
    if dtype not in (torch.float32, torch.bfloat16) or data.dim() != 2 or not kernels_usable(data):
        return None
    transposed = not data.is_contiguous()
    source = data.t() if transposed else data
    if not source.is_contiguous():
        return None
    rows, k = qt.unpacked_shape_2d
    out = torch.empty(rows, k, dtype=dtype)
    out_view = numpy_view(out.view(torch.uint16) if dtype == torch.bfloat16 else out)
    with launch_kernels():
        _compiled_values().fold_fp4_values(
            numpy_view(source), transposed, numpy_view(scales.contiguous()), qt.granularity.block, _e2m1_values(),
            out_view, dtype == torch.bfloat16,
        )
    return out


@functools.cache
def _e2m1_values():
    """The float32 value of every E2M1 code, as a NumPy array."""
    from .e2m1 import E2M1_VALUES

    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([values, -values]).numpy()


@functools.cache
def _compiled_values():
    from . import numba_fp4_values

    return numba_fp4_values
