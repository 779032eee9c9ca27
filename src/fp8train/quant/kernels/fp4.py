"""The 4-bit family's CPU kernel, compiled by numba: bit-identical to the reference path of
:mod:`fp8train.quant.fp4_quantize` for every 4-bit rule: ``nvfp4`` (1x16) and ``mxfp4``
(1x32) along either axis, ``nvfp4_2d`` (16x16 tiles), each rounded to nearest even or
stochastically, and ``nvfp4`` with the random Hadamard transform along either axis.

NVFP4 takes two reads in one launch: the tensor's amax (the FP8 kernels' ``max_magnitude``;
with the transform, the amax of the transformed values, computed and not stored) and its
global scales, in float32 as the reference's ``nvfp4_global_scales`` computes them; then per
group the (transformed) values' amax, the E4M3 block scale and the E2M1 cast. MXFP4 takes
one read. Stochastic rounding draws the reference's very ``torch.rand`` tensor (one float32
draw per value, from the same generator) and hands it to the kernel, so the bits and the
generator's state both match; it draws once the global amax is known not to be NaN (a
launch of its own): a NaN amax leaves the tensor to the reference path, which draws then.

What a rule and axis decide (the kernel, the group, the scale arguments) is decided once
(:func:`launch_plan`): a quantization is a few tensors, one launch and the
:class:`QuantizedTensor` (issue 38: the host's calls).

:func:`quantize` is what the 4-bit family's door (:mod:`fp8train.quant.quantize`) calls for
a tensor :func:`.launch.kernels_usable` takes; it declines (``None``) an NVFP4 tensor whose
(transformed or given) global amax is NaN, or is given on another device, which the
reference path then quantizes. The functions below it
lay out the arguments and launch :mod:`.numba_fp4` and :mod:`.numba_fp4_transform`.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from ...spec.formats import E4M3
from ...spec.granularities import view_2d_shape
from ...spec.rule import QuantRule
from ..tensor import QuantizedTensor, quantized_tensor, transpose
from .fp8_rule import cast_encoding, rule_scale_args
from .launch import BITS_LIKE, KERNEL_LAUNCH, kernel_input

__all__ = ["quantize", "quantize_fp4_blocks", "transformed_amax", "launch_plan", "transpose_with_values"]

MXFP4, GIVEN_AMAX, COMPUTE_AMAX, AMAX_ONLY = 0, 1, 2, 3
"""The kernels' ``mode`` (:mod:`.numba_fp4`): no global scale; NVFP4 under a given global
amax; NVFP4 under the amax the kernel computes first; that amax alone."""


class LaunchPlan(NamedTuple):
    """What a 4-bit rule and axis decide of a launch, once (:func:`launch_plan`).

    Attributes:
        kernel: the entry point by address (:mod:`.numba_fp4`, :mod:`.numba_fp4_transform`).
        rows, cols: one group's shape in the 2-D view (a 4-bit group's is the view's own).
        tails: the kernel's last arguments but one by input dtype: ``(block, round_to, rule,
            e4m3)`` (the group's values along the axis, or the tile's side; the transform's
            rounding, to the input's dtype; the scale rule; the E4M3 cast).
        nvfp4: two-level scales (a global amax).
        scale_dtype: the scales' dtype (E4M3 or E8M0).
    """

    kernel: Callable
    rows: int
    cols: int
    tails: dict
    nvfp4: bool
    scale_dtype: torch.dtype


@functools.cache
def launch_plan(rule: QuantRule, axis: int) -> LaunchPlan:
    """The :class:`LaunchPlan` of ``rule`` (4-bit) along ``axis`` (-1 or 0); the kernels
    compile on first use (numba imports: :func:`.launch.kernels_usable` said so)."""
    from . import numba_fp4, numba_fp4_transform

    granularity = rule.granularity
    rows, cols = granularity.group_shape(axis, (granularity.block, granularity.block))
    constants = (rule_scale_args(rule, torch.float32), cast_encoding(E4M3))
    if rule.rht:
        kernel = numba_fp4_transform.quantize_rht_runs_at if axis == -1 else numba_fp4_transform.quantize_rht_columns_at
    elif rows > 1 and cols > 1:
        kernel = numba_fp4.quantize_fp4_tiles_at
    else:
        kernel = numba_fp4.quantize_fp4_groups_at if axis == -1 else numba_fp4.quantize_fp4_columns_at
    return LaunchPlan(
        kernel=kernel,
        rows=rows,
        cols=cols,
        tails={dtype: (cols if axis == -1 else rows, round_to, *constants) for dtype, round_to in _ROUND_TO.items()},
        nvfp4=granularity.two_level_scales,
        scale_dtype=torch.float8_e8m0fnu if granularity.e8m0_scales else torch.float8_e4m3fn,
    )


def quantize(
    x: torch.Tensor,
    rule: QuantRule,
    axis: int,
    scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    global_amax: torch.Tensor | None = None,
    values: torch.dtype | None = None,
) -> QuantizedTensor | None:
    """``x`` quantized by the 4-bit ``rule`` along ``axis`` (normalized: -1 or 0), as
    :func:`fp8train.quant.fp4_quantize.quantize_fp4` computes it, NVFP4 under ``global_amax``
    (float32 scalar) where given, else ``x``'s own (after the transform); ``None`` where the
    reference must decide the bits (a NaN amax, or one given on another device). Stochastic
    rounding draws from ``generator`` (``None``: PyTorch's default) exactly what the reference
    path draws, so the generator ends in the same state. (``scale``: the door's uniform
    signature; 4-bit rules take none.)

    ``values``: also write the emulated GEMM's operand of the K-last result (its transpose
    along ``axis=0``), of this dtype (float32 or bfloat16), in the same launch, into its
    ``gemm_cache``: what :func:`fp8train.quant.gemm.fp4.fp4_operand_values` would fold the
    codes to. A layer whose GEMM takes the tensor at once asks for it (issue 38); ``None``:
    codes only."""
    try:  # a 2-D tensor (the layer's) needs no reshape
        m, k = x.shape
        x2d, leading = x.contiguous(), None
    except ValueError:
        m, k = view_2d_shape(x.shape)
        x2d, leading = x.detach().reshape(m, k).contiguous(), x.shape[:-1]
    out = None if values is None else torch.empty((m, k) if axis == -1 else (k, m), dtype=values)
    quantized = quantize_fp4_blocks(x2d, rule, axis, global_amax, generator, out)
    if quantized is None:
        # Every NVFP4 scale is then NaN, and which NaN code (0x7F or 0xFF) the reference
        # stores depends on PyTorch's vector path: the reference path decides it (and draws).
        return None
    data, scales, global_amax = quantized
    if leading is not None and axis == -1:  # data keeps x's leading dims (axis 0: the 2-D view's)
        data = data.reshape(*leading, k // 2)
    granularity = rule.granularity
    qt = quantized_tensor(data, scales, granularity, axis, granularity.always_power_2, global_amax)
    if out is not None:  # held in this tensor's orientation: its K-last transpose takes out itself
        cache = qt.gemm_cache
        cache.compute_dtype, cache.values, cache.out_scale = values, out if axis == -1 else out.t(), None
    return qt


def transpose_with_values(qt: QuantizedTensor, values: torch.dtype) -> QuantizedTensor:
    """:func:`~fp8train.quant.tensor.transpose` of the 2-D 4-bit ``qt``, with the K-last GEMM
    operand of the transpose (of dtype ``values``) in its ``gemm_cache``, for a caller whose
    GEMM takes it at once (a layer's reused weight tiles, issue 38). For ``nvfp4_2d``
    codes and scales as a kernel here stores them (contiguous) and no operand cached yet,
    one launch repacks the codes along the new last dim (where the transpose takes seven
    PyTorch ops) and folds the operand from them (where the GEMM would launch again);
    for anything else the transpose itself."""
    data, scales, granularity = qt.data, qt.scale_inv, qt.granularity
    cache = qt.gemm_cache
    if not (granularity.fp4 and granularity.symmetric) or (cache is not None and cache.values is not None):
        return transpose(qt)
    if data.ndim != 2 or not (data.is_contiguous() and scales.is_contiguous()):
        return transpose(qt)
    rows, k = data.shape[0], 2 * data.shape[1]
    codes, out = torch.empty((k, rows // 2), dtype=data.dtype), torch.empty((k, rows), dtype=values)
    args = (data.data_ptr(), scales.data_ptr(), rows, k, codes.data_ptr(), out.data_ptr(), values == torch.bfloat16)
    if KERNEL_LAUNCH.depth:  # this thread holds the kernels (a layer's block): no block of its own
        _transpose_kernel()(*args, granularity.block, granularity.two_level_scales)
    else:
        with KERNEL_LAUNCH:
            _transpose_kernel()(*args, granularity.block, granularity.two_level_scales)
    transposed = quantized_tensor(codes, scales.t(), granularity, qt.axis, qt.power_2_scales, qt.global_amax)
    target = transposed.gemm_cache
    target.compute_dtype, target.values, target.out_scale = values, out, None
    if cache is not None:  # as transpose() links them (the partner holds its values already)
        cache.transposed = target
    return transposed


@functools.cache
def _transpose_kernel():
    from .numba_fp4_values import transpose_tiles_at

    return transpose_tiles_at


def transformed_amax(x2d: torch.Tensor, axis: int) -> torch.Tensor:
    """``max |rht(x2d)|`` along ``axis`` (the transform rounded to ``x2d``'s dtype) as a float32
    scalar tensor, NaN if any transformed value is NaN; the transform is not stored."""
    plan, amax = launch_plan(QuantRule(granularity="nvfp4", rht=True), axis), torch.empty((), dtype=torch.float32)
    with KERNEL_LAUNCH:
        source = kernel_input(x2d)
        args = (source.data_ptr(), BITS_LIKE[source.dtype], *source.shape, 0, 0, 0, amax.data_ptr(), AMAX_ONLY)
        plan.kernel(*args, *plan.tails[x2d.dtype], False, 0, False)
    return amax


def quantize_fp4_blocks(
    x2d: torch.Tensor,
    rule: QuantRule,
    axis: int,
    global_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Quantize the contiguous 2-D ``x2d`` (M, K) by the 4-bit ``rule`` along ``axis`` (-1: one
    row by the block, or 16x16 tiles for ``nvfp4_2d``; 0: the block by one column), after the
    transform with ``rule.rht``; NVFP4 under the scales of the float32 ``global_amax``, or of
    the amax the kernel computes where it is ``None``, MXFP4 under none; stochastically with
    ``rule.stochastic_rounding`` (one uniform draw per value from ``generator``, as the
    reference draws them), else to nearest even. ``values``: a contiguous float32 or
    bfloat16 tensor the K-last GEMM operand is written into (``[M, K]``, or ``[K, M]`` along
    ``axis=0``), or ``None``.

    Returns:
        ``(data, scales, global_amax)``: the E2M1 codes two a byte along ``axis``
        (``torch.float4_e2m1fn_x2``), (M, K/2) or (M/2, K); the stored scales (E4M3 for
        NVFP4, E8M0 for MXFP4), one per group (M, K/block), (M/block, K) or (M/16, K/16);
        NVFP4's float32 global amax (as given, or computed: a scalar). ``None`` where that
        amax is NaN (nothing drawn), or is given on another device.
    """
    plan = launch_plan(rule, axis)
    m, k = x2d.shape
    data = torch.empty((m, k // 2) if axis == -1 else (m // 2, k), dtype=torch.float4_e2m1fn_x2)
    scales = torch.empty((m // plan.rows, k // plan.cols), dtype=plan.scale_dtype)
    if not plan.nvfp4:
        mode, amax = MXFP4, None
    elif global_amax is None:
        mode, amax = COMPUTE_AMAX, torch.empty((), dtype=torch.float32)
    elif global_amax.device.type != "cpu":
        return None  # the kernels read it where it lies: the reference path takes another device's
    else:
        mode = GIVEN_AMAX
        amax = global_amax if global_amax.dtype == torch.float32 else global_amax.to(torch.float32)
    source = x2d if x2d.dtype != torch.float16 else kernel_input(x2d)  # held until the launches
    args = (source.data_ptr(), BITS_LIKE[source.dtype], m, k, data.data_ptr(), scales.data_ptr())
    out = (0, False) if values is None else (values.data_ptr(), values.dtype == torch.bfloat16)
    launch = (plan, args, 0 if amax is None else amax.data_ptr(), mode, plan.tails[x2d.dtype], out)
    stochastic = rule.stochastic_rounding
    if stochastic and mode == GIVEN_AMAX and bool(amax.isnan()):
        return None  # nothing is drawn for a NaN global amax (the reference path draws then)
    if KERNEL_LAUNCH.depth:  # this thread holds the kernels (a layer's block): no block of its own
        quantized = _launch(*launch, stochastic, generator)
    else:
        with KERNEL_LAUNCH:
            quantized = _launch(*launch, stochastic, generator)
    return (data, scales, amax if global_amax is None else global_amax) if quantized else None


def _launch(
    plan: LaunchPlan, args: tuple, amax_at: int, mode: int, tail: tuple, out: tuple, stochastic: bool, generator
) -> bool:
    """:func:`quantize_fp4_blocks`' launch (``args``: the kernel's first six; ``out``: its
    last two); whether the global amax is not NaN (nothing quantized, nothing drawn where it is).

    Stochastic rounding draws the reference's ``torch.rand`` (``e2m1._round_stochastically``:
    one draw over its groups view, from the same generator, after the same draw-free steps;
    in memory, (M, K)) before the launch, which computes the amax, then quantizes. The
    reference draws nothing for a NaN amax: there the generator's state, kept before the
    draw, is put back (a launch less than reading the amax first, issue 38)."""
    if not stochastic:
        return plan.kernel(*args, 0, amax_at, mode, *tail, False, *out)
    m, k = args[2:4]
    source = torch.default_generator if generator is None else generator
    state = source.get_state() if mode == COMPUTE_AMAX else None  # (a given amax is known not NaN)
    shape = (m // plan.rows, plan.rows, k // plan.cols, plan.cols)  # (on the CPU whatever the default device)
    draws = torch.rand(shape, generator=generator, dtype=torch.float32, device="cpu")
    if plan.kernel(*args, draws.data_ptr(), amax_at, mode, *tail, True, *out):
        return True
    if state is not None:
        source.set_state(state)
    return False


_ROUND_TO = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""How the transform's kernels round a transformed value: to the input's dtype."""
