"""The 4-bit family's GPU quantizer: the reference's arithmetic, fused by inductor.

The reference (:mod:`fp8train.quant.fp4_quantize`) in eager PyTorch ops runs the random
Hadamard transform as 16 passes over the tensor, the E2M1 cast as a bucketize, stochastic
rounding through int64 temporaries, and NVFP4's two-level scales as a dozen small kernels.
Here the same steps run in one call compiled by ``torch.compile`` (inductor), for every
usage asked for, each by its own rule (:class:`Usage`: both from one read where the
autograd wants both, also where they differ, as the NVFP4 recipe's input and grad_output
do: no transform on the last-dim usage, the transform on the grad_weight GEMM's), each
in the layout its GEMM takes:

* the last-dim usage (``axis=-1``) packed along K, row-major, as the reference;
* the first-dim usage (``axis=0``) of a 2-D tensor column-major: ``data`` is the ``.t()``
  view of the contiguous ``[K, M/2]`` bytes, so its transpose, the K-last operand, is
  contiguous and the GEMM copies nothing. (A tensor of rank > 2 keeps the reference's layout.)

Where a layer's GEMM takes a usage at once (:func:`quantize_operand`, :func:`quantize_pair`
with ``gemm_values``), the same pass also writes the emulated GEMM's operand: each E2M1
value times its block scale, in the GEMM's dtype (:func:`gemm_values_dtype`), the K-last
layout contiguous, into the tensor's ``gemm_cache``, which the GEMM reads in place of the
codes (:func:`~fp8train.quant.gemm.fp4.fp4_operand_values`'s bits: the product is exact in
float32, so bfloat16 or float32 holds it). A first-dim usage's values are its transpose's
(``[K, M]``), which :func:`~fp8train.quant.tensor.transpose` hands on. They live as long as
the tensor, as the GEMM's own would: not where the forward saves a usage for the backward
(``prepare_for_saving`` leaves the cache behind), so none are written for the input's
first-dim usage.

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
  from the same generator, one usage after the other, the last-dim usage first, a usage
  that rounds to nearest drawing nothing), and passed in: the compiled function draws
  nothing, so the codes and the generator's state after are the reference's;
* NVFP4's global amax is each usage's own (after its transform, if it has one), as each
  reference call computes it, unless one is given;
* the E2M1 cast counts the midpoints ``|v|`` passes (ties to even) as the reference's
  ``torch.bucketize`` does, and the stochastic cast takes ``(v - lo) * (1 / (hi - lo))``, the
  reference's exact quotient by a power of two.

``tests/quant/kernels/test_compiled_fp4.py`` runs the same code through inductor's CPU
backend against the reference; the GPU suite (``tests/gpu/test_quantize_kernel.py``) holds
the Triton kernels to the CPU's bytes
(``tests/quant/kernels/test_compiled_fp4_operands.py`` and the GPU suite's
``test_quantize_kernel_fp4.py`` the pairs of rules and the GEMM values). Variants compile per input shape as
:class:`.compiled_fp8.CompiledKernel` says. The CPU keeps its numba kernels
(:mod:`.fp4`); this quantizer serves CUDA tensors only (the door's ``"cuda"`` entry).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ...spec.granularities import view_2d_shape
from ...spec.rule import QuantRule
from ..e2m1 import pack_e2m1
from ..hadamard import random_hadamard_transform
from ..scaling import FLOAT32_MAX, NVFP4_GLOBAL_RANGE, e8m0_to_float32, exp2_int, mx_scale_exponent
from ..tensor import QuantizedTensor, quantized_tensor
from .compiled_fp8 import CompiledKernel, compiled_usable
from .settings import quant_settings

__all__ = [
    "SERVED_GRANULARITIES", "COMPILE_OPTIONS", "Usage", "quantize", "quantize_operand", "quantize_both",
    "quantize_pair", "quantize_usages", "quantize_each", "stochastic_draws", "gemm_values_dtype",
]

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


class Usage(NamedTuple):
    """One usage a kernel variant quantizes: its rule, its axis (normalized), the dtype of
    the emulated GEMM's operand values it writes with the codes (``None``: none), and
    whether the GEMM takes it transposed (a first-dim usage: also one whose rule has no
    axis, ``nvfp4_2d``'s, quantized along -1), whose values are then written in the
    transpose's layout (``[K, M]`` contiguous; ``False`` where it writes none: one variant)."""

    rule: QuantRule
    axis: int
    values: torch.dtype | None = None
    transposed: bool = False


def _usage(x2d, usage: Usage, column_major: bool, global_amax, draws):
    """One usage's ``(packed codes, stored scales, global amax, GEMM operand values or None)``
    of the 2-D ``x2d``."""
    rule, axis = usage.rule, usage.axis
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
    codes = _e2m1_codes(scaled, draws)
    values = None if usage.values is None else _operand_values(codes, scale_inv, usage, (m, k))
    codes = codes.reshape(m, k)
    if axis == -1:
        packed = pack_e2m1(codes, -1)
    else:
        packed = pack_e2m1(codes.t(), -1) if column_major else pack_e2m1(codes, 0)
    return packed, scale_inv.reshape(m // rows, k // cols), global_amax, values


def _operand_values(codes: torch.Tensor, scale_inv: torch.Tensor, usage: Usage, shape) -> torch.Tensor:
    """The emulated GEMM's K-last operand of these codes (groups view) and their stored
    block scales (E4M3, or E8M0's exponent bits), as
    :func:`~fp8train.quant.gemm.fp4.fp4_operand_values` computes it from the stored tensor:
    each E2M1 value times its block scale in float32, rounded to ``usage.values``;
    ``[M, K]`` contiguous, or ``[K, M]`` (the transpose's own layout) where the GEMM takes
    the usage transposed."""
    index = (codes & 7).to(torch.int32)
    magnitude = torch.where(index < 6, index - 2.0, torch.where(index == 6, 4.0, 6.0))
    magnitude = torch.where(index < 4, index * 0.5, magnitude).to(torch.float32)
    value = torch.where((codes & 8) != 0, -magnitude, magnitude)  # code 8 is -0.0, as e2m1_to_float32's
    e8m0 = usage.rule.granularity.e8m0_scales
    decoded = e8m0_to_float32(scale_inv) if e8m0 else scale_inv.to(torch.float32)
    values = (value * decoded).to(usage.values).reshape(shape)
    return values.t().contiguous() if usage.transposed else values


@functools.cache
def _quantize_kernel(usages: tuple[Usage, ...], column_major: bool) -> CompiledKernel:
    """Every usage's ``(packed codes, scales, global amax, values)`` of a 2-D tensor, each by
    its own rule along its axis, in one compiled function of ``(x2d, global_amax, draws)``:
    ``global_amax`` the given one or ``None`` (each usage's own), ``draws`` one tensor (or
    ``None``) per usage, or ``None``."""

    def quantize(x2d: torch.Tensor, global_amax: torch.Tensor | None, draws: tuple | None):
        return tuple(
            _usage(x2d, usage, column_major, global_amax, None if draws is None else draws[i])
            for i, usage in enumerate(usages)
        )

    return CompiledKernel(quantize, COMPILE_OPTIONS)


def stochastic_draws(x2d: torch.Tensor, rule: QuantRule, axes: tuple[int, ...], generator) -> tuple | None:
    """The reference's uniform draws for the usages of ``axes``, in their order: one float32
    ``torch.rand`` of each usage's groups view on ``x2d``'s device, from ``generator``
    (``None``: PyTorch's default); ``None`` for a rule that rounds to nearest."""
    return _draws(x2d, tuple(Usage(rule, axis) for axis in axes), generator)


def _draws(x2d: torch.Tensor, usages: tuple[Usage, ...], generator) -> tuple | None:
    """:func:`stochastic_draws` for usages of their own rules: a draw for each usage that
    rounds stochastically (``None`` for the others), in the usages' order; ``None`` if none does."""
    if not any(usage.rule.stochastic_rounding for usage in usages):
        return None
    m, k = x2d.shape
    draws = []
    for rule, axis, _, _ in usages:
        if not rule.stochastic_rounding:
            draws.append(None)
            continue
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
    return quantize_each(x, tuple(Usage(rule, axis) for axis in axes), generator, global_amax)


def quantize_each(
    x: torch.Tensor, usages: tuple[Usage, ...], generator=None, global_amax=None
) -> tuple[QuantizedTensor, ...] | None:
    """:func:`quantize_usages` for usages of their own rules (4-bit, each usage's axis
    normalized): ``x``'s quantization by each, as the reference's calls one after the other
    give them (drawing alike), from one compiled call; a usage with ``values`` also holds its
    emulated GEMM operand in its ``gemm_cache`` (a first-dim usage's in its transpose's
    layout, which :func:`~fp8train.quant.tensor.transpose` hands on). ``None`` where the
    kernel failed to compile (nothing drawn then)."""
    x2d = x.reshape(view_2d_shape(x.shape))
    column_major = x.dim() == 2
    kernel = _quantize_kernel(usages, column_major)
    if kernel.failed:
        return None
    stochastic = any(usage.rule.stochastic_rounding for usage in usages)
    if stochastic and generator is None:
        generator = _default_generator(x.device)  # the same draws as None's, and a state to restore
    state = generator.get_state() if stochastic else None
    outputs = kernel(x2d, global_amax, _draws(x2d, usages, generator))
    if outputs is None:
        if state is not None:
            generator.set_state(state)  # the reference draws again, from where it was
        return None
    return tuple(_quantized(x, usage, column_major, *output) for usage, output in zip(usages, outputs))


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator ``torch.rand(..., generator=None)`` draws from on ``device``."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _quantized(x, usage: Usage, column_major: bool, packed, scales, global_amax, values) -> QuantizedTensor:
    granularity, axis = usage.rule.granularity, usage.axis
    data = packed.view(torch.float4_e2m1fn_x2)
    if axis == -1:
        data = data.reshape(*x.shape[:-1], x.shape[-1] // 2)
    elif column_major:
        data = data.t()
    scales = scales.view(torch.float8_e8m0fnu) if granularity.e8m0_scales else scales
    amax = global_amax if granularity.two_level_scales else None
    qt = quantized_tensor(data, scales, granularity, axis, granularity.always_power_2, amax)
    if values is not None:
        # In this tensor's own orientation (a transposed usage's: the view of the [K, M] values).
        qt.gemm_cache.put(usage.values, values.t() if usage.transposed else values, None)
    return qt


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


def quantize_operand(
    x: torch.Tensor, rule: QuantRule, axis: int, scale: torch.Tensor | None = None
) -> QuantizedTensor | None:
    """:func:`quantize` for a caller whose GEMM takes the tensor at once (a layer's bound
    kernels): the emulated GEMM's operand values (:func:`gemm_values_dtype`) written in the
    same pass, into its ``gemm_cache``, so the GEMM does not read the codes again."""
    if not _serves(x, rule):
        return None
    quantized = quantize_each(x, (Usage(rule, axis, gemm_values_dtype(), axis == 0),))
    return None if quantized is None else quantized[0]


def quantize_pair(
    x: torch.Tensor,
    last_rule: QuantRule,
    first_rule: QuantRule,
    first_axis: int,
    gemm_values: tuple[bool, bool] = (False, False),
) -> tuple[QuantizedTensor, QuantizedTensor] | None:
    """Both usages from one read, each by its own rule: ``(quantize(x, last_rule, -1),
    quantize(x, first_rule, first_axis))`` as those two calls give them, drawing alike from
    PyTorch's default generator (the last-dim usage's draws first); the first-dim usage of
    a 2-D tensor column-major. ``gemm_values``: for each usage, whether it also holds the
    emulated GEMM's operand values (a layer's GEMM takes it at once). ``None`` where it
    leaves ``x`` to those calls."""
    if not (_serves(x, last_rule) and _serves(x, first_rule)):
        return None
    dtype = gemm_values_dtype() if gemm_values[0] or gemm_values[1] else None
    last = Usage(last_rule, -1, dtype if gemm_values[0] else None)
    first = Usage(first_rule, first_axis, dtype, True) if gemm_values[1] else Usage(first_rule, first_axis)
    return quantize_each(x, (last, first))


def gemm_values_dtype() -> torch.dtype:
    """The dtype of the emulated GEMM's operands on a GPU under the current settings: what
    :func:`~fp8train.quant.gemm.emulated.emulated_gemm_dtype` chooses off the CPU (bfloat16,
    float32 where the settings ask for it). The GEMM takes cached values of its own dtype
    only, so values of another would be converted again, never misread."""
    return torch.float32 if quant_settings().emulated_gemm == "float32" else torch.bfloat16


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
