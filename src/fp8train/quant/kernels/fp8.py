"""The FP8 family's CPU kernel, compiled by numba: bit-identical to the reference path of
:mod:`fp8train.quant.fp8_quantize`.

The reference is written in PyTorch ops, one pass over the data per op, and runs
everywhere. On CPU these kernels do the same arithmetic in one or two reads of the input:
per scaling group, the amax (as the maximum of the magnitude bits), the scale (NUMERICS.md
section 2, or the E8M0 rule), and the round-to-nearest-even saturating cast, computed from
the float32 bits:

* normal FP8 values: add half an FP8 ulp minus one, plus the bit that breaks ties to even,
  and shift the float32 exponent and mantissa fields down;
* FP8 subnormals: add ``smallest subnormal * 2^23`` in float32, whose rounding puts the
  value on the FP8 subnormal grid (8 is the smallest normal's code, so the codes join);
* ``|v| >= max`` saturates; NaN becomes the positive NaN code. (NUMERICS.md leaves a NaN's
  sign open, and the reference's own depends on which PyTorch vector path ran.)

:func:`quantize` and :func:`quantize_both` are what the FP8 family's door
(:mod:`fp8train.quant.quantize`) calls for a tensor :func:`.launch.kernels_usable` takes;
the functions below them lay out the arguments and launch :mod:`.numba_fp8`, which computes.
The tests hold every kernel to the reference on every granularity, axis, format, input
dtype and input class (zeros, subnormals, infinities, NaN, saturation, ties).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...spec.formats import FloatFormat
from ...spec.granularities import view_2d_shape
from ...spec.rule import QuantRule
from ..cast import HIGH_PRECISION_DTYPES
from ..fp8_quantize import fp8_tensor
from ..tensor import QuantizedTensor, quantized_tensor
from .fp8_rule import KERNEL_RULE_KEY, cast_encoding, kernel_rule_of, rule_scale_args, value_decoding
from .delayed import fold_amax
from .launch import BITS_DTYPE, BITS_LIKE, KERNEL_LAUNCH, STRIPE_BYTES, float32_scalar, kernel_input, kernels_usable

__all__ = [
    "quantize",
    "quantize_both",
    "try_tensor_amax",
    "quantize_groups",
    "quantize_both_usages",
    "quantize_tensor",
    "tensor_amax",
    "cast_with_scale",
    "rule_scale_args",
    "cast_encoding",
    "reads_both_at_once",
]


def quantize(
    x: torch.Tensor, rule: QuantRule, axis: int, scale: torch.Tensor | None, generator=None, global_amax=None,
    values: torch.dtype | None = None, amax: torch.Tensor | None = None,
) -> QuantizedTensor:
    """``x`` quantized by the FP8 ``rule`` along ``axis`` (normalized; ``scale``: a given
    per-tensor scale), as :func:`fp8train.quant.fp8_quantize.quantize_fp8` computes it.
    (``generator`` and ``global_amax``: the door's uniform signature; FP8 rules use neither.)

    ``values``: also write the emulated GEMM's operand of the result, of this dtype (float32
    or bfloat16), in the same pass, into its ``gemm_cache``: what
    :func:`fp8train.quant.gemm.emulated.emulated_mm` would convert the codes to (its codes'
    values times power-of-two scales; bare values, the GEMM applying the scale, for a
    per-tensor scale that is not one). A layer asks for it (issue 38); ``None``: codes only.

    ``amax``: a float32 element of a CPU tensor (delayed scaling's current amax of ``x``'s
    role) to fold ``max|x|`` into as :func:`.delayed.fold_amax` does, in the read that casts
    where a scale is given (issue 38), else in one of its own; ``None``: nowhere.
    """
    try:  # a 2-D tensor (the layer's) needs no reshape
        m, k = x.shape
        x2d, two_d = x.contiguous(), True
    except ValueError:
        m, k = view_2d_shape(x.shape)
        x2d, two_d = x.reshape(m, k).contiguous(), False
    granularity = rule.granularity
    try:  # kernel_rule_of, inline: a subscript, no call (issue 38)
        kernel_rule = rule.__dict__[KERNEL_RULE_KEY]
    except KeyError:
        kernel_rule = kernel_rule_of(rule)
    power_2 = granularity.always_power_2 or (rule.power_2_scales and scale is None)
    if values is None:
        out, request = None, (0, 0, kernel_rule.decoding[power_2])
    else:
        out = torch.empty((m, k), dtype=values)
        request = (out.data_ptr(), VALUES_KIND[values], kernel_rule.decoding[power_2])
    if granularity.per_tensor and scale is None:
        codes, scale_inv = quantize_tensor(x2d, rule, request, kernel_rule)
    elif granularity.per_tensor:  # (a delayed buffer's scale is float32: no conversion)
        scale = scale if scale.dtype is torch.float32 else scale.to(dtype=torch.float32)
        # cast_with_scale's launch, inline (issue 38): the codes in the rule's dtype, its kept
        # encoding, no block of its own in a layer's; max|x| folded into amax in the same read.
        source = x2d if x2d.dtype is not torch.float16 else kernel_input(x2d)
        codes = torch.empty((m, k), dtype=kernel_rule.dtype)  # the kernel writes its bytes
        args = (source.data_ptr(), BITS_LIKE[source.dtype], m, k, codes.data_ptr(), np.float32(float(scale)))
        args = (*args, kernel_rule.encoding, *request, 0 if amax is None else amax.data_ptr())
        if KERNEL_LAUNCH.depth:
            _compiled().cast_scaled_at(*args)
        else:
            with KERNEL_LAUNCH:
                _compiled().cast_scaled_at(*args)
        amax, scale_inv = None, scale.reciprocal()  # (folded)
        two_d = two_d and scale_inv.shape == ()
    else:
        rows, cols = granularity.group_shape(axis, (m, k))
        codes, scale_inv = quantize_groups(x2d, rows, cols, rule, request, kernel_rule)
    if amax is not None and 0 not in x2d.shape:  # (computed scales: a read of its own)
        with KERNEL_LAUNCH:
            fold_amax(x2d, amax)
    if two_d:  # codes and scales in their final shapes: the QuantizedTensor as it is (issue 38)
        qt = quantized_tensor(codes, scale_inv, granularity, axis, power_2)
    else:
        qt = fp8_tensor(x, codes, scale_inv, granularity, axis, power_2, (m, k), False)
    if out is not None:
        if not (power_2 or granularity.per_tensor):
            raise ValueError(f"{granularity} scales that are not powers of two do not fold into a GEMM operand")
        cache = qt.gemm_cache  # the emulated GEMM's operand, as it would keep it
        cache.compute_dtype, cache.values, cache.out_scale = values, out, None if power_2 else scale_inv
    return qt


def quantize_both(
    x: torch.Tensor, rule: QuantRule, scale: torch.Tensor | None = None, values: tuple | None = None
) -> tuple[QuantizedTensor, QuantizedTensor] | None:
    """Both usages of ``x`` (axis -1, then axis 0) from one read, as :func:`quantize_both_usages`;
    ``None`` where no fused kernel takes ``rule`` (it takes groups one value across: ``row``,
    ``block1x128``, ``mx``, their scales computed). ``values``: each usage's operand dtype
    or ``None``, as :func:`quantize`'s (``None``: neither)."""
    granularity = rule.granularity
    if scale is not None or granularity.symmetric or granularity.across != 1:  # reads_both_at_once, inline
        return None
    try:  # a 2-D tensor (the layer's) needs no reshape
        shape_2d = x.shape
        m, k = shape_2d
        x2d, two_d = x.contiguous(), True
    except ValueError:
        shape_2d = view_2d_shape(x.shape)
        x2d, two_d = x.reshape(shape_2d).contiguous(), False
    try:  # as quantize's
        kernel_rule = rule.__dict__[KERNEL_RULE_KEY]
    except KeyError:
        kernel_rule = kernel_rule_of(rule)
    power_2 = rule.power_2_scales or granularity.always_power_2
    last_dtype, first_dtype = (None, None) if values is None else values
    out_last = None if last_dtype is None else torch.empty(shape_2d, dtype=last_dtype)
    out_first = None if first_dtype is None else torch.empty(shape_2d, dtype=first_dtype)
    request = (
        0 if out_last is None else out_last.data_ptr(), VALUES_KIND[last_dtype],
        0 if out_first is None else out_first.data_ptr(), VALUES_KIND[first_dtype],
        kernel_rule.decoding[power_2],
    )
    (codes_last, scales_last), (codes_first, scales_first) = quantize_both_usages(x2d, rule, request, kernel_rule)
    if two_d:  # codes and scales in their final shapes (quantize_both_usages)
        last = quantized_tensor(codes_last, scales_last, granularity, -1, power_2)
        first = quantized_tensor(codes_first, scales_first, granularity, 0, power_2)
    else:
        last = fp8_tensor(x, codes_last, scales_last, granularity, -1, power_2, shape_2d, False)
        first = fp8_tensor(x, codes_first, scales_first, granularity, 0, power_2, shape_2d, False)
    # The operands the kernel wrote, kept as the emulated GEMM would (as quantize keeps its own).
    if out_last is not None:
        cache = last.gemm_cache
        cache.compute_dtype, cache.values, cache.out_scale = last_dtype, out_last, None
    if out_first is not None:
        cache = first.gemm_cache
        cache.compute_dtype, cache.values, cache.out_scale = first_dtype, out_first, None
    return last, first


def reads_both_at_once(granularity) -> bool:
    """Whether :func:`quantize_both` reads a tensor once for both usages of ``granularity``
    (computed scales): groups one value across (``row``, ``block1x128``, ``mx``). A symmetric
    one's first-dim usage is the last-dim one transposed: one quantization serves both."""
    return not granularity.symmetric and granularity.across == 1


VALUES_KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2}
"""How the kernels write an operand of each dtype (``None``: not at all)."""


def try_tensor_amax(x: torch.Tensor) -> torch.Tensor | None:
    """``max |x|`` as a float32 scalar (as :func:`tensor_amax`), or ``None`` where the
    kernels do not apply (or do not read ``x``'s dtype)."""
    if x.dtype not in HIGH_PRECISION_DTYPES or not kernels_usable(x):
        return None
    return tensor_amax(x.detach().reshape(-1, x.shape[-1] if x.dim() else 1).contiguous())


@functools.cache
def _compiled():
    """The compiled FP8 kernels (numba imports: :func:`.launch.kernels_usable` said so)."""
    from . import numba_fp8

    return numba_fp8


def quantize_groups(
    x2d: torch.Tensor, rows: int, cols: int, rule: QuantRule, values: tuple = (0, 0, None), kernel_rule=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the contiguous 2-D ``x2d`` (M, K) by ``rule`` with one scale per
    ``rows x cols`` group (``values``: where the kernel writes the operand, its kind and
    decoding, as :func:`quantize` asks; kind 0: nowhere; ``kernel_rule``: the rule's
    :class:`KernelRule`, where the caller has it).

    Returns:
        ``(codes, scales)``: codes of shape (M, K) in the rule's FP8 dtype, and float32 ``1 / scale`` (or
        E8M0 codes for E8M0 scales) of shape ``(M // rows, K // cols)``.
    """
    m, n = x2d.shape
    kernel_rule = kernel_rule_of(rule) if kernel_rule is None else kernel_rule
    codes = torch.empty((m, n), dtype=kernel_rule.dtype)  # the kernel writes its bytes
    scales = torch.empty((m // rows, n // cols), dtype=kernel_rule.scale_dtype)  # E8M0: the kernel stores the codes
    source = x2d if x2d.dtype != torch.float16 else kernel_input(x2d)
    args = (source.data_ptr(), BITS_LIKE[source.dtype], m, n, codes.data_ptr(), scales.data_ptr())
    rule_args = (kernel_rule.scale_args[x2d.dtype], kernel_rule.encoding)
    values = values if values[2] is not None else (0, 0, kernel_rule.decoding[True])
    k = _compiled()
    if rows == 1:
        kernel, args = k.quantize_row_groups_at, (*args, cols, *rule_args, *values)
    elif rows == m and cols == 1:
        kernel, args = k.quantize_column_groups_at, (*args, 4 * _threads(), *rule_args, *values)
    else:
        width = _stripe_width(rows, cols, n, x2d.dtype.itemsize)
        kernel, args = k.quantize_stripe_groups_at, (*args, rows, cols, width, *rule_args, *values)
    if KERNEL_LAUNCH.depth:  # this thread holds the kernels (a layer's block): no block of its own
        kernel(*args)
    else:
        with KERNEL_LAUNCH:
            kernel(*args)
    return codes, scales


def quantize_both_usages(
    x2d: torch.Tensor, rule: QuantRule, values: tuple | None = None, kernel_rule=None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Both usages of the contiguous ``x2d`` (M, K) by ``rule`` from one read: groups of
    1 x ``block`` (axis -1) and ``block`` x 1 (axis 0), ``block`` the granularity's length
    along the axis (``None`` for ``row``: whole rows, whole columns). ``values``: where the
    kernel writes each usage's operand, as :func:`quantize_both` asks (``None``: nowhere;
    ``kernel_rule``: as :func:`quantize_groups`'s).

    Returns:
        ``((codes, scales) for axis -1, (codes, scales) for axis 0)``, as :func:`quantize_groups`.
    """
    block = rule.granularity.along
    m, n = x2d.shape
    kernel_rule = kernel_rule_of(rule) if kernel_rule is None else kernel_rule
    scale_dtype = kernel_rule.scale_dtype
    codes_last, codes_first = torch.empty((m, n), dtype=kernel_rule.dtype), torch.empty((m, n), dtype=kernel_rule.dtype)
    if block is None:
        scales_last, scales_first = torch.empty((m, 1), dtype=scale_dtype), torch.empty((1, n), dtype=scale_dtype)
    else:
        scales_last = torch.empty((m, n // block), dtype=scale_dtype)
        scales_first = torch.empty((m // block, n), dtype=scale_dtype)
    source = x2d if x2d.dtype != torch.float16 else kernel_input(x2d)
    # The addresses one by one: a generator would cost a call per tensor (issue 38).
    args = (
        source.data_ptr(),
        BITS_LIKE[source.dtype],
        m,
        n,
        codes_last.data_ptr(),
        codes_first.data_ptr(),
        scales_last.data_ptr(),
        scales_first.data_ptr(),
    )
    rule_args = (kernel_rule.scale_args[x2d.dtype], kernel_rule.encoding)
    values = (0, 0, 0, 0, kernel_rule.decoding[True]) if values is None else values
    k = _compiled()
    if block is None:
        kernel, args = k.quantize_both_rows_at, (*args, 4 * _threads(), *rule_args, values)
    else:
        width = _stripe_width(block, block, n, x2d.dtype.itemsize)
        kernel, args = k.quantize_both_blocks_at, (*args, block, width, *rule_args, values)
    if KERNEL_LAUNCH.depth:  # held by a layer's block (quantize_groups)
        kernel(*args)
    else:
        with KERNEL_LAUNCH:
            kernel(*args)
    return (codes_last, scales_last), (codes_first, scales_first)


def _threads() -> int:
    """PyTorch's thread count: as the launch this thread holds took it, or asked."""
    return KERNEL_LAUNCH.threads if KERNEL_LAUNCH.depth else torch.get_num_threads()



@functools.cache  # keyed by integers: a lookup with no Python call (issue 38)
def _stripe_width(rows: int, cols: int, n: int, itemsize: int) -> int:
    """Columns per task of the strided-group kernel: a whole number of groups, about
    :data:`STRIPE_BYTES` of input, at least 16 columns (one vector) where there are that many."""
    width = max(16, STRIPE_BYTES // (rows * itemsize))
    width = max(cols, width // cols * cols)
    return min(width, n)


def quantize_tensor(
    x2d: torch.Tensor, rule: QuantRule, values: tuple = (0, 0, None), kernel_rule=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for all of the contiguous 2-D ``x2d`` by the per-tensor ``rule``, in one
    kernel call (amax, scale, cast: two reads). Returns ``(codes, scale_inv)``,
    ``scale_inv`` a float32 scalar. ``values``, ``kernel_rule``: as :func:`quantize_groups`'s."""
    (m, n), source = x2d.shape, x2d if x2d.dtype != torch.float16 else kernel_input(x2d)
    kernel_rule = kernel_rule_of(rule) if kernel_rule is None else kernel_rule
    codes = torch.empty((m, n), dtype=kernel_rule.dtype)  # the kernel writes its bytes
    values = values if values[2] is not None else (0, 0, kernel_rule.decoding[True])
    args = (source.data_ptr(), BITS_LIKE[source.dtype], m, n, codes.data_ptr(), kernel_rule.scale_args[x2d.dtype])
    kernel = _compiled().quantize_tensor_at
    if KERNEL_LAUNCH.depth:  # held by a layer's block (quantize_groups)
        _, stored = kernel(*args, kernel_rule.encoding, *values)
    else:
        with KERNEL_LAUNCH:
            _, stored = kernel(*args, kernel_rule.encoding, *values)
    return codes, torch.tensor(float(stored), dtype=torch.float32)


def tensor_amax(x2d: torch.Tensor) -> torch.Tensor:
    """``max |x2d|`` as a float32 scalar tensor (NaN if any element is NaN), one read."""
    source = kernel_input(x2d)
    (m, n), address = source.shape, source.data_ptr()
    with KERNEL_LAUNCH:
        k = _compiled()
        bits = k.max_magnitude_at(address, BITS_LIKE[source.dtype], m, n, 0)
    return torch.tensor(int(bits), dtype=BITS_DTYPE[source.dtype]).view(source.dtype).to(torch.float32)


def cast_with_scale(x2d: torch.Tensor, scale: float, fmt: FloatFormat, values: tuple = (0, 0, None)) -> torch.Tensor:
    """``cast_to_fp8(x2d * scale)`` as uint8 codes, the product rounded as float32 rounds it
    (``values``: as :func:`quantize_groups`'s; the values stay bare)."""
    (m, n), source = x2d.shape, kernel_input(x2d)
    codes = torch.empty((m, n), dtype=torch.uint8)
    args = (source.data_ptr(), BITS_LIKE[source.dtype], m, n, codes.data_ptr())
    values = values if values[2] is not None else (0, 0, value_decoding(fmt, False, True))
    with KERNEL_LAUNCH:
        k = _compiled()
        k.cast_scaled_at(*args, float32_scalar(scale), cast_encoding(fmt), *values, 0)
    return codes
