"""The 4-bit family's GPU quantizer: the reference's arithmetic, fused by inductor.

The reference (:mod:`fp8train.quant.fp4_quantize`) in eager PyTorch ops runs the random
Hadamard transform as 16 passes over the tensor, the E2M1 cast as a bucketize, stochastic
rounding through int64 temporaries, and NVFP4's two-level scales as a dozen small kernels.
Here the same steps run in one call compiled by ``torch.compile`` (inductor), for every
usage asked for (both from one read where the autograd wants both under one rule), each
in the layout its GEMM takes:

* the last-dim usage (``axis=-1``) packed along K, row-major, as the reference;
* the first-dim usage (``axis=0``) of a 2-D tensor column-major: ``data`` is the ``.t()``
  view of the contiguous ``[K, M/2]`` bytes, so its transpose, the K-last operand, is
  contiguous and the GEMM copies nothing. (A tensor of rank > 2 keeps the reference's layout.)

The bits are the reference's, on the same generator state:

* the transform is :func:`~fp8train.quant.hadamard.random_hadamard_transform` itself (its
  sum in index order), the E2M1 exponents :func:`~fp8train.quant.scaling.mx_scale_exponent`
  and :func:`~fp8train.quant.scaling.exp2_int` themselves;
* NVFP4's divisions (``2688 / global_amax``, ``1 / ge``, ``1 / (dec * gd)``) run in float64
  and round once to float32: the correctly rounded float32 quotient, which PyTorch's float32
  division gives and Triton's ``/`` need not (as :mod:`.compiled_fp8` does);
* every kernel compiles with inductor's ``emulate_precision_casts``, which also turns off
  Triton's fusion of ``a * b + c`` into one FMA: the transform's sum rounds each product
  (exact but where it is a float32 subnormal) and each sum, as the reference does;
* stochastic rounding's uniform draws are drawn eagerly, outside the compiled function,
  exactly as the reference draws them (``torch.rand`` of each usage's groups view, float32,
  from the same generator, one usage after the other), and passed in: the compiled
  function draws nothing, so the codes and the generator's state after are the reference's;
* the E2M1 cast counts the midpoints ``|v|`` passes (ties to even) as the reference's
  ``torch.bucketize`` does, and the stochastic cast takes ``(v - lo) * (1 / (hi - lo))``, the
  reference's exact quotient by a power of two.

``tests/quant/kernels/test_compiled_fp4.py`` runs the same code through inductor's CPU
backend against the reference; the GPU suite (``tests/gpu/test_quantize_kernel.py``) holds
the Triton kernels to the CPU's bytes. Variants compile per input shape as
:class:`.compiled_fp8.CompiledKernel` says. The CPU keeps its numba kernels
(:mod:`.fp4`); this quantizer serves CUDA tensors only (the door's ``"cuda"`` entry).
"""

from __future__ import annotations

import functools

import torch

from ...spec.granularities import view_2d_shape
from ...spec.rule import QuantRule
from ..e2m1 import pack_e2m1
from ..hadamard import random_hadamard_transform
from ..scaling import FLOAT32_MAX, NVFP4_GLOBAL_RANGE, exp2_int, mx_scale_exponent
from ..tensor import QuantizedTensor, quantized_tensor
from .compiled_fp8 import CompiledKernel, compiled_usable

__all__ = ["SERVED_GRANULARITIES", "COMPILE_OPTIONS", "quantize", "quantize_both", "quantize_usages", "stochastic_draws"]

SERVED_GRANULARITIES = frozenset({"nvfp4", "nvfp4_2d", "mxfp4"})
"""Every 4-bit granularity (its speed against the reference is unmeasured: no GPU yet)."""

COMPILE_OPTIONS = {"emulate_precision_casts": True}
"""Inductor's options for every 4-bit kernel: casts rounded where the graph has them, and no
FMA contraction in Triton (the module docstring)."""

_E2M1_MAX = 6.0
# The reference's bucketize boundaries as float32 values: the midpoints between E2M1
# magnitudes, the ones above an odd index one float32 step down (a tie goes to the even one).
_RNE_BOUNDARIES = tuple(
    float(torch.nextafter(torch.tensor(m), torch.tensor(0.0))) if i % 2 else m
    for i, m in enumerate((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
)
_SIXTH = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))  # float32(1/6), as the reference's scalar
_E2M1_STEPS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 1-7


def _divide(numerator: torch.Tensor | float, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` correctly rounded to float32 (in float64, rounded once)."""
    return (numerator / denominator.to(torch.float64)).to(torch.float32)


def _at_most_float32_max(t: torch.Tensor) -> torch.Tensor:
    return torch.minimum(t, torch.full_like(t, FLOAT32_MAX))  # NaN propagates, as the reference's


def _nvfp4_scales(group_amax: torch.Tensor, global_amax: torch.Tensor):
    """:func:`~fp8train.quant.scaling.nvfp4_block_scales`' ``(dec, enc)``, its divisions
    correctly rounded on every device."""
    ge = _at_most_float32_max(_divide(NVFP4_GLOBAL_RANGE, global_amax.to(torch.float32)))
    ge = torch.where(ge == 0, torch.ones_like(ge), ge)
    gd = _divide(1.0, ge)
    dec = _at_most_float32_max(group_amax * (ge * _SIXTH)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    enc = _at_most_float32_max(_divide(1.0, dec.to(torch.float32) * gd))
    return dec, enc


def _mx_scales(group_amax: torch.Tensor, rule: QuantRule):
    """MXFP4's ``(E8M0 exponent bits, scale)``, as the reference's ``_mx_scales``."""
    exponent = mx_scale_exponent(group_amax, rule.fp8_max, rule.mx_scale_rule)
    scale = exp2_int(127 - exponent.to(torch.int32))
    return exponent, torch.where(exponent == 0xFF, torch.full_like(scale, float("nan")), scale)


def _e2m1_codes(v: torch.Tensor, draws: torch.Tensor | None) -> torch.Tensor:
    """The E2M1 codes of float32 ``v`` clamped to ``[-6, 6]``, as
    :func:`~fp8train.quant.e2m1.cast_to_e2m1` gives them (stochastically with ``draws``)."""
    magnitude = v.abs()
    if draws is None:
        index = sum((magnitude > boundary).to(torch.int32) for boundary in _RNE_BOUNDARIES)
        index = torch.where(torch.isnan(magnitude), 0, index)  # NaN: code 0
    else:
        lower = sum((magnitude >= step).to(torch.int32) for step in _E2M1_STEPS)
        # The value of the code below |v|, and 1 / the gap to the one above (1 at the top).
        low = torch.where(lower < 4, lower * 0.5, torch.where(lower < 6, lower - 2.0, torch.where(lower == 6, 4.0, 6.0)))
        inverse_gap = torch.where(lower < 4, 2.0, torch.where(lower < 6, 1.0, torch.where(lower == 6, 0.5, 1.0)))
        probability = (magnitude - low.to(torch.float32)) * inverse_gap.to(torch.float32)
        index = lower + (draws < probability).to(torch.int32)  # NaN compares false: code 0
    return index.to(torch.uint8) | (v < 0).to(torch.uint8) * 8


def _usage(x2d, rule: QuantRule, axis: int, column_major: bool, global_amax, draws):
    """One usage's ``(packed codes, stored scales, global amax)`` of the 2-D ``x2d``."""
    if rule.rht:
        x2d = random_hadamard_transform(x2d, axis)
    m, k = x2d.shape
    rows, cols = rule.granularity.group_shape(axis, (m, k))
    x_groups = x2d.reshape(m // rows, rows, k // cols, cols)
    group_amax = x_groups.abs().to(torch.float32).amax(dim=(1, 3), keepdim=True)
    if rule.granularity.two_level_scales:
        global_amax = group_amax.amax() if global_amax is None else global_amax
        scale_inv, enc = _nvfp4_scales(group_amax, global_amax)
    else:
        scale_inv, enc = _mx_scales(group_amax, rule)
    scaled = (x_groups.to(torch.float32) * enc).clamp(-_E2M1_MAX, _E2M1_MAX)
    codes = _e2m1_codes(scaled, draws).reshape(m, k)
    if axis == -1:
        packed = pack_e2m1(codes, -1)
    else:
        packed = pack_e2m1(codes.t(), -1) if column_major else pack_e2m1(codes, 0)
    return packed, scale_inv.reshape(m // rows, k // cols), global_amax


@functools.cache
def _quantize_kernel(axes: tuple[int, ...], rule: QuantRule, column_major: bool) -> CompiledKernel:
    """Every usage's ``(packed codes, scales, global amax)`` of a 2-D tensor by ``rule``, one per
    axis of ``axes``, in one compiled function of ``(x2d, global_amax, draws)``: ``global_amax``
    the given one or ``None`` (each usage's own), ``draws`` one tensor per usage or ``None``."""

    def quantize(x2d: torch.Tensor, global_amax: torch.Tensor | None, draws: tuple | None):
        return tuple(
            _usage(x2d, rule, axis, column_major, global_amax, None if draws is None else draws[i])
            for i, axis in enumerate(axes)
        )

    return CompiledKernel(quantize, COMPILE_OPTIONS)


def stochastic_draws(x2d: torch.Tensor, rule: QuantRule, axes: tuple[int, ...], generator) -> tuple | None:
    """The reference's uniform draws for the usages of ``axes``, in their order: one float32
    ``torch.rand`` of each usage's groups view on ``x2d``'s device, from ``generator``
    (``None``: PyTorch's default); ``None`` for a rule that rounds to nearest."""
    if not rule.stochastic_rounding:
        return None
    m, k = x2d.shape
    draws = []
    for axis in axes:
        rows, cols = rule.granularity.group_shape(axis, (m, k))
        shape = (m // rows, rows, k // cols, cols)
        draws.append(torch.rand(shape, generator=generator, dtype=torch.float32, device=x2d.device))
    return tuple(draws)


def quantize_usages(
    x: torch.Tensor, rule: QuantRule, axes: tuple[int, ...], generator=None, global_amax=None
) -> tuple[QuantizedTensor, ...] | None:
    """``x``'s quantization along each of ``axes`` (normalized) by the 4-bit ``rule``, as
    :func:`~fp8train.quant.fp4_quantize.quantize_fp4` calls one after the other give them
    (drawing alike from ``generator``), from one compiled call; ``None`` where its kernel
    failed to compile (nothing drawn then: the reference draws)."""
    x2d = x.reshape(view_2d_shape(x.shape))
    column_major = x.dim() == 2
    kernel = _quantize_kernel(axes, rule, column_major)
    if kernel.failed:
        return None
    if rule.stochastic_rounding and generator is None:
        generator = _default_generator(x.device)  # the same draws as None's, and a state to restore
    state = generator.get_state() if rule.stochastic_rounding else None
    outputs = kernel(x2d, global_amax, stochastic_draws(x2d, rule, axes, generator))
    if outputs is None:
        if state is not None:
            generator.set_state(state)  # the reference draws again, from where it was
        return None
    return tuple(_quantized(x, rule, axis, column_major, *output) for axis, output in zip(axes, outputs))


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator ``torch.rand(..., generator=None)`` draws from on ``device``."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _quantized(x, rule: QuantRule, axis: int, column_major: bool, packed, scales, global_amax) -> QuantizedTensor:
    granularity = rule.granularity
    data = packed.view(torch.float4_e2m1fn_x2)
    if axis == -1:
        data = data.reshape(*x.shape[:-1], x.shape[-1] // 2)
    elif column_major:
        data = data.t()
    scales = scales.view(torch.float8_e8m0fnu) if granularity.e8m0_scales else scales
    amax = global_amax if granularity.two_level_scales else None
    return quantized_tensor(data, scales, granularity, axis, granularity.always_power_2, amax)


def _serves(x: torch.Tensor, rule: QuantRule) -> bool:
    return str(rule.granularity) in SERVED_GRANULARITIES and compiled_usable(x)


def quantize(
    x: torch.Tensor, rule: QuantRule, axis: int, scale: torch.Tensor | None = None, generator=None, global_amax=None
) -> QuantizedTensor | None:
    """:func:`fp8train.quant.fp4_quantize.quantize_fp4`'s bits (and draws) from one compiled
    call (arguments checked by the door); ``None`` where it leaves ``x`` to the reference.
    (``scale``: the door's uniform signature; 4-bit rules take none.)"""
    if not _serves(x, rule):
        return None
    quantized = quantize_usages(x, rule, (axis,), generator, global_amax)
    return None if quantized is None else quantized[0]


def quantize_both(
    x: torch.Tensor, rule: QuantRule, scale: torch.Tensor | None = None
) -> tuple[QuantizedTensor, QuantizedTensor] | None:
    """Both usages (axis -1, then axis 0 column-major; ``nvfp4_2d``, whose tiles have no
    axis: the one quantization twice) from one read of ``x``, as two :func:`quantize` calls
    give them, drawing from PyTorch's default generator; ``None`` where it leaves ``x``."""
    if not _serves(x, rule):
        return None
    if rule.axis_free:
        if rule.stochastic_rounding:
            return None  # two quantizations draw twice: no one read gives that
        quantized = quantize_usages(x, rule, (-1,))
        return None if quantized is None else (quantized[0], _copy(quantized[0]))
    return quantize_usages(x, rule, (-1, 0))


def _copy(qt: QuantizedTensor) -> QuantizedTensor:
    """The same bytes in a tensor of its own (its own GEMM cache)."""
    return quantized_tensor(qt.data, qt.scale_inv, qt.granularity, qt.axis, qt.power_2_scales, qt.global_amax)
