"""Quantization's door: a high-precision tensor and a :class:`~fp8train.spec.rule.QuantRule`
in, a :class:`~fp8train.quant.tensor.QuantizedTensor` out.

:func:`quantize` checks its arguments and asks the rule's format family (FP8: ``tensor``,
``row``, ``block1x128``, ``block128x128``, ``mx``; 4-bit: ``nvfp4``, ``nvfp4_2d``,
``mxfp4``) for its quantizers. Behind each family's door sit its reference, in PyTorch ops on
any device (:mod:`fp8train.quant.fp8_quantize`, :mod:`fp8train.quant.fp4_quantize`), and
its kernels by device type (on CPU the numba kernels of :mod:`fp8train.quant.kernels`), each
held bit for bit to the reference. :func:`quantizers_for` is the one place that chooses.

A GPU kernel is one more entry of a family's ``kernels``, keyed by device type: a
:class:`Quantizer` whose ``takes`` says which tensors it serves (dtype, shape, the
settings) and whose ``quantize`` returns the reference's bits (``None`` for a tensor whose
bits it leaves to the reference), with ``quantize_both`` where it reads a tensor once for
both usages. Each family has its ``"cuda"`` one: the reference's arithmetic fused by
inductor (:mod:`fp8train.quant.kernels.compiled_fp8`, :mod:`fp8train.quant.kernels.compiled_fp4`),
which also writes the first-dim usage of a 2-D tensor in the layout its GEMM takes.

The public ``fp8train.quant.quantize`` (a granularity and options) builds a rule and calls
:func:`quantize` (:mod:`fp8train.quant.public`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import torch

from ..spec.checks import check_type
from ..spec.rule import QuantRule
from .cast import HIGH_PRECISION_DTYPES, check_tensor
from .fp4_quantize import quantize_fp4
from .fp8_quantize import quantize_fp8, quantize_fp8_usages
from .kernels import compiled_fp4, compiled_fp8
from .kernels import fp4 as fp4_kernels
from .kernels import fp8 as fp8_kernels
from .kernels.launch import kernels_enabled, kernels_usable
from .tensor import QuantizedTensor

__all__ = ["quantize", "quantize_both", "quantize_both_in_one_read", "quantizers_for", "bound_quantizers", "PLAIN_TENSOR_TYPES", "Quantizer", "FamilyQuantizers", "FAMILIES", "no_one_read"]


def no_one_read(x: torch.Tensor, rule: QuantRule, scale: torch.Tensor | None = None) -> None:
    """The ``quantize_both`` of a quantizer with no one read of both usages: ``None``, always
    (a role quantizer that finds it here asks for two quantizations without calling it)."""
    return None


def _every_tensor(x: torch.Tensor) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class Quantizer:
    """One implementation of a format family's quantization, bit-identical to the family's
    reference.

    Attributes:
        name: what it is, in words (``"reference"``, ``"numba"``).
        quantize: ``(x, rule, axis, scale, generator, global_amax)`` (checked, ``axis``
            normalized, ``global_amax`` a float32 scalar on ``x``'s device or ``None``) to
            the :class:`QuantizedTensor`, or ``None`` where it leaves ``x``'s bits to the
            reference (the reference never does).
        quantize_both: ``(x, rule, scale)`` to both usages ``(axis -1, axis 0)`` from one
            read of ``x`` (``scale``: a given per-tensor scale, or ``None``), or ``None``
            where it has no such kernel for them (two quantizations then). The FP8
            reference's, for a layer's bound calls only: one call, two reads.
        takes: whether it serves ``x`` at all (a kernel's own conditions: the settings,
            the tensor's type and size); the reference takes every tensor.
        enabled: whether it serves any tensor now (the settings, its library): the part
            of ``takes`` that does not look at the tensor.
        untraced: ``quantize`` for a caller that knows ``torch.compile`` does not trace it
            (a layer's bound kernels: no asking on each call), or ``None`` (the same).
        quantize_pair: ``(x, last_rule, first_rule, first_axis, gemm_values=(False, False))``
            to both usages ``(axis -1 by last_rule, first_axis by first_rule)`` from one read,
            each by its own rule, as the two ``quantize`` calls give them (drawing from
            PyTorch's default generator in that order), ``gemm_values`` saying for each
            whether it also holds the emulated GEMM's operand values; or ``None`` where it
            leaves ``x`` to the two calls. ``None``: no such kernel.
        operand: ``(x, rule, axis, scale)`` as ``quantize``, for a caller whose GEMM takes
            the tensor at once (a layer's bound kernels): the emulated GEMM's operand values
            written in the same pass into its ``gemm_cache``; ``None``: ``quantize``.
    """

    name: str
    quantize: Callable[..., QuantizedTensor | None]
    quantize_both: Callable[..., tuple[QuantizedTensor, QuantizedTensor] | None] = no_one_read
    takes: Callable[[torch.Tensor], bool] = _every_tensor
    enabled: Callable[[], bool] = bool
    untraced: Callable[..., QuantizedTensor | None] | None = None
    quantize_pair: Callable[..., tuple[QuantizedTensor, QuantizedTensor] | None] | None = None
    operand: Callable[..., QuantizedTensor | None] | None = None


@dataclass(frozen=True, kw_only=True)
class FamilyQuantizers:
    """A format family's door: its reference and its kernels by device type.

    Attributes:
        reference: PyTorch ops on any device; serves every tensor no kernel takes.
        kernels: device type (``x.device.type``) to the kernel that serves it there.
    """

    reference: Quantizer
    kernels: Mapping[str, Quantizer]


def _cpu_kernel(quantize, quantize_both=no_one_read) -> Quantizer:
    return Quantizer(
        name="numba", quantize=quantize, quantize_both=quantize_both, takes=kernels_usable, enabled=kernels_enabled
    )


_GPU_FP8 = Quantizer(
    name="inductor", quantize=compiled_fp8.quantize, quantize_both=compiled_fp8.quantize_both,
    takes=compiled_fp8.compiled_usable, enabled=compiled_fp8.compiled_enabled,
)

_GPU_FP4 = Quantizer(
    name="inductor", quantize=compiled_fp4.quantize, quantize_both=compiled_fp4.quantize_both,
    takes=compiled_fp8.compiled_usable, enabled=compiled_fp8.compiled_enabled,
    quantize_pair=compiled_fp4.quantize_pair, operand=compiled_fp4.quantize_operand,
)


FAMILIES: Mapping[int, FamilyQuantizers] = MappingProxyType(
    {
        8: FamilyQuantizers(
            reference=Quantizer(
                name="reference", quantize=quantize_fp8, untraced=functools.partial(quantize_fp8, traced=False),
                quantize_both=quantize_fp8_usages,
            ),
            kernels=MappingProxyType(
                {"cpu": _cpu_kernel(fp8_kernels.quantize, fp8_kernels.quantize_both), "cuda": _GPU_FP8}
            ),
        ),
        4: FamilyQuantizers(
            reference=Quantizer(
                name="reference", quantize=quantize_fp4, untraced=functools.partial(quantize_fp4, traced=False)
            ),
            kernels=MappingProxyType({"cpu": _cpu_kernel(fp4_kernels.quantize), "cuda": _GPU_FP4}),
        ),
    }
)
"""Each format family's door, by its data bits (``rule.granularity.data_bits``): its
reference, and its kernels by device type (the module docstring)."""


def quantizers_for(rule: QuantRule, x: torch.Tensor) -> tuple[Quantizer | None, Quantizer]:
    """``(kernel, reference)``: who quantizes ``x`` by ``rule``, the one choice. ``kernel``
    is the rule's family's kernel for ``x``'s device type where one takes ``x`` (else
    ``None``); ``reference`` is the family's reference, which serves whatever the kernel
    does not.

    Raises:
        RuntimeError: the settings ask for the numba kernels and numba cannot be imported.
    """
    family = FAMILIES[rule.granularity.data_bits]
    kernel = family.kernels.get(x.device.type)
    return (kernel if kernel is not None and kernel.takes(x) else None), family.reference


def bound_quantizers(data_bits: int, device_type: str) -> tuple[Callable, Callable, Callable | None, Callable | None]:
    """``(quantize, quantize_both, reference, quantize_pair)``: the format family's
    quantizers (:attr:`FamilyQuantizers`, by ``data_bits``) for tensors of ``device_type``
    that the caller has checked (plain, not empty, of a high-precision dtype, outside
    ``torch.compile``) and multiplies at once, chosen once for a layer's calls under the
    current settings: ``quantize(x, rule, axis, scale)`` (a :class:`Quantizer`'s
    ``operand`` where it has one), ``quantize_both(x, rule, scale)`` and ``quantize_pair``
    as a :class:`Quantizer`'s (``None`` where they leave ``x``; ``quantize_pair`` ``None``
    where there is none), ``reference`` what serves what they leave. With no kernel enabled
    there: the reference, its both-usages call, ``None``, ``None``.

    Raises:
        RuntimeError: the settings ask for the numba kernels and numba cannot be imported.
    """
    family = FAMILIES[data_bits]
    kernel, reference = family.kernels.get(device_type), family.reference
    reference_quantize = reference.quantize if reference.untraced is None else reference.untraced
    if kernel is None or not kernel.enabled():
        return reference_quantize, reference.quantize_both, None, None
    quantize = kernel.quantize if kernel.operand is None else kernel.operand
    return quantize, kernel.quantize_both, reference_quantize, kernel.quantize_pair


PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
"""The tensor types that are not subclasses (a DTensor's ops must dispatch): a ``type(x) in``
test, no ``isinstance()`` call (issue 38)."""


def _check_arguments(x, rule: QuantRule, axis, scale, generator=None, global_amax=None) -> int:
    """Validate :func:`quantize`'s arguments; return the normalized axis."""
    if type(x) not in PLAIN_TENSOR_TYPES and not isinstance(x, torch.Tensor):
        check_tensor("x", x)
    if type(rule) is not QuantRule:
        check_type("rule", rule, QuantRule, "a QuantRule (fp8train.spec.QuantRule)")
    if generator is not None:
        check_type("generator", generator, torch.Generator, "a torch.Generator")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"quantize takes float32, bfloat16 or float16 input, got {x.dtype}")
    if scale is not None and not isinstance(scale, torch.Tensor):
        check_tensor("scale", scale)
    axis = rule.check_input(tuple(x.shape), axis, scale_given=scale is not None, noun="tensor")
    if scale is not None and (scale.numel() != 1 or not scale.is_floating_point()):
        raise ValueError(
            f"scale must be a one-element floating-point tensor, got shape {tuple(scale.shape)} of {scale.dtype}"
        )
    if global_amax is not None:
        _check_global_amax(global_amax, rule)
    return axis


def _check_global_amax(global_amax, rule: QuantRule) -> None:
    check_tensor("global_amax", global_amax)
    if not rule.granularity.two_level_scales:
        raise ValueError(
            f"global_amax is for NVFP4's two-level scales ('nvfp4', 'nvfp4_2d'), not granularity "
            f"{str(rule.granularity)!r}; leave it None"
        )
    if global_amax.numel() != 1 or global_amax.dtype != torch.float32:
        raise ValueError(
            f"global_amax must be a one-element float32 tensor, got shape {tuple(global_amax.shape)} of "
            f"{global_amax.dtype}"
        )


def quantize(
    x: torch.Tensor,
    rule: QuantRule,
    *,
    axis: int = -1,
    scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    global_amax: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` to FP8 (or 4 bits) by ``rule``, one scale per scaling group
    (NUMERICS.md sections 2-3 and 6).

    Args:
        x: float32, bfloat16 or float16 tensor. Ranks > 2 behave as their 2-D view
            ``(prod(leading dims), last dim)``; any strides.
        rule: the granularity, format and scale rule (:class:`~fp8train.spec.rule.QuantRule`).
        axis: -1 puts the scaling groups along the last dim (rowwise usage), 0 along the
            first (columnwise usage). Ignored by ``tensor`` and ``block128x128``.
        scale: a precomputed float32 scale (per-tensor rules only, e.g. delayed scaling);
            skips the amax pass.
        generator: where stochastic rounding (``rule.stochastic_rounding``) draws from
            (``None``: PyTorch's default generator); unused otherwise.
        global_amax: NVFP4 only (``nvfp4``, ``nvfp4_2d``): the one-element float32 amax of
            the whole tensor ``x`` is part of (after the transform, where ``rule.rht``), in
            place of ``x``'s own: every shard of a distributed tensor quantized with the
            MAX of the shards' amaxes gets the codes and scales of the whole tensor's
            quantization (:mod:`fp8train.parallel.gather`). ``None``: ``x``'s own amax.

    Returns:
        A :class:`QuantizedTensor` whose ``data`` has ``x``'s shape (4-bit: packed two
        values a byte along the scaling axis, :mod:`fp8train.quant.fp4_quantize`).

    Raises:
        ValueError: an input dtype other than float32, bfloat16 or float16; an unsupported
            axis, or a shape the granularity cannot tile (rank, or a dim not divisible by
            the block); a scale with a rule that is not per-tensor, or not one float.
            A ``global_amax`` for a granularity other than NVFP4's, or not one float32.
        TypeError: ``x``, ``scale`` or ``global_amax`` not a tensor, ``rule`` not a
            QuantRule, ``axis`` not an int, ``generator`` not a ``torch.Generator``.
    """
    axis = _check_arguments(x, rule, axis, scale, generator, global_amax)
    if global_amax is not None:
        global_amax = global_amax.detach().to(device=x.device).reshape(())
    kernel, reference = quantizers_for(rule, x)
    quantized = None if kernel is None else kernel.quantize(x, rule, axis, scale, generator, global_amax)
    return reference.quantize(x, rule, axis, scale, generator, global_amax) if quantized is None else quantized


def quantize_both(
    x: torch.Tensor, rule: QuantRule, *, scale: torch.Tensor | None = None
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Both usages of ``x`` by ``rule``: ``(quantize(x, rule, axis=-1, scale=scale),
    quantize(x, rule, axis=0, scale=scale))``.

    Equal, bit for bit, to the two calls. On CPU the ``row``, ``block1x128`` and ``mx``
    granularities read ``x`` once for both (twice for ``row``), where the two calls read it
    two to three times; on a GPU every FP8 granularity does, and writes the ``axis=0``
    usage column-major (its transpose, the K-last operand, contiguous). Arguments and
    errors as :func:`quantize`.
    """
    both = quantize_both_in_one_read(x, rule, scale=scale)
    if both is None:  # no one-read kernel for this rule here: two quantizations
        return quantize(x, rule, axis=-1, scale=scale), quantize(x, rule, axis=0, scale=scale)
    return both


def quantize_both_in_one_read(
    x: torch.Tensor, rule: QuantRule, *, scale: torch.Tensor | None = None
) -> tuple[QuantizedTensor, QuantizedTensor] | None:
    """:func:`quantize_both`'s result where a kernel here reads ``x`` once for both usages;
    ``None`` where none does (the caller chooses what to do instead: reuse a quantization,
    or quantize twice)."""
    _check_arguments(x, rule, 0, scale)
    kernel, _ = quantizers_for(rule, x)
    return None if kernel is None else kernel.quantize_both(x, rule, scale)
