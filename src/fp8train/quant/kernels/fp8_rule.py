"""What the FP8 kernels of :mod:`.numba_fp8` take of a rule, computed once per rule (and
format, and input dtype) rather than per call: the scale rule's constants, the cast's
encoding, the GEMM operand's decoding (issue 38: a layer quantizes three tensors a step).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ...spec.formats import FloatFormat
from ...spec.hash_once import MEMO_PREFIX
from ...spec.rule import QuantRule
from ..cast import DTYPE_BY_NAME
from ..scaling import FLOAT32_MAX
from .launch import float32_scalar

__all__ = ["KernelRule", "KERNEL_RULE_KEY", "kernel_rule_of", "value_decoding", "rule_scale_args", "cast_encoding"]


class KernelRule(NamedTuple):
    """What the kernels take of one FP8 rule, looked up once per quantization.

    Attributes:
        dtype: the codes' FP8 dtype.
        scale_args: :func:`rule_scale_args` per input dtype.
        encoding: :func:`cast_encoding` of the rule's format.
        decoding: :func:`value_decoding` of the operand's values, by whether its scales are
            powers of two (``False``: the values stay bare).
        scale_dtype: the stored scales' dtype: E8M0 codes for the MX rules (the kernels
            compute each exponent in float32 and store its code), else float32 ``1 / scale``.
    """

    dtype: torch.dtype
    scale_args: dict
    encoding: tuple
    decoding: dict
    scale_dtype: torch.dtype


KERNEL_RULE_KEY = MEMO_PREFIX + "fp8_kernel_rule"
"""Where a rule keeps its :class:`KernelRule` (``rule.__dict__[KERNEL_RULE_KEY]``: a hot
path reads it with no call, :func:`kernel_rule_of` where it is not there yet)."""


def kernel_rule_of(rule: QuantRule) -> KernelRule:
    """The :class:`KernelRule` of ``rule``, built once and kept on the rule."""
    try:
        return rule.__dict__[KERNEL_RULE_KEY]
    except KeyError:
        kernel_rule = rule.__dict__[KERNEL_RULE_KEY] = _kernel_rule(rule)
        return kernel_rule


def _kernel_rule(rule: QuantRule) -> KernelRule:
    e8m0 = rule.granularity.e8m0_scales
    return KernelRule(
        dtype=DTYPE_BY_NAME[rule.format.dtype_name],  # the rule's format is checked: no torch_dtype
        scale_args={dtype: rule_scale_args(rule, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)},
        encoding=cast_encoding(rule.format),
        decoding={power_2: value_decoding(rule.format, e8m0, not power_2) for power_2 in (False, True)},
        scale_dtype=torch.float8_e8m0fnu if e8m0 else torch.float32,
    )


@functools.cache
def value_decoding(fmt: FloatFormat, e8m0: bool, bare: bool) -> tuple:
    """How the kernels turn ``fmt``'s codes into the GEMM's operand (:mod:`.numba_fp8_values`):
    the value's field shift, the multiplier back, the first special magnitude, the infinity's
    code (none for E4M3), whether stored scales are E8M0 exponents, whether the values stay
    bare (not multiplied by their scales)."""
    import numpy as np

    e4m3 = fmt.exponent_bits == 4
    shift, restore = (20, 2.0**120) if e4m3 else (21, 2.0**112)
    special, inf_code = (0x7F, 0x100) if e4m3 else (0x7C, 0x7C)
    return np.uint32(shift), np.float32(restore), np.uint32(special), np.uint32(inf_code), bool(e8m0), bool(bare)


@functools.cache
def rule_scale_args(rule: QuantRule, x_dtype: torch.dtype) -> tuple:
    """How a group's amax becomes its scale under ``rule`` for an input of ``x_dtype``, as
    the kernels take it; computed once per rule and dtype. E8M0 groups store their biased
    exponent (as float32), the others ``1 / scale``."""
    granularity = rule.granularity
    kind = (1 if rule.mx_scale_rule == "ceil" else 2) if granularity.e8m0_scales else 0
    emax = int(float32_scalar(rule.fp8_max).view("uint32") >> 23) - 127
    # Block scales that overflow take the input dtype's largest value (NUMERICS.md).
    inf_scale_value = torch.finfo(x_dtype).max if granularity.block else FLOAT32_MAX
    return (
        kind,
        float32_scalar(rule.fp8_max),
        float32_scalar(1.0 / rule.fp8_max),
        emax,
        bool(rule.power_2_scales),
        float32_scalar(rule.amax_epsilon),
        float32_scalar(inf_scale_value),
    )


@functools.cache
def cast_encoding(fmt: FloatFormat) -> tuple:
    """The cast's constants for ``fmt``: field shift, exponent rebias, the bits of the largest
    finite value and its code, the bits of the smallest normal, the subnormal rounding
    addend and its bits."""
    import numpy as np

    shift = 23 - fmt.mantissa_bits
    rebias = (127 - fmt.bias) << fmt.mantissa_bits
    max_bits = int(np.float32(fmt.max).view(np.uint32))
    max_code = ((max_bits >> shift) - rebias) & 0xFF
    min_normal_bits = int(np.float32(fmt.smallest_normal).view(np.uint32))
    magic = np.float32(fmt.smallest_subnormal * 2.0**23)
    return tuple(np.uint32(v) for v in (shift, rebias, max_bits, max_code, min_normal_bits)) + (
        magic,
        np.uint32(magic.view(np.uint32)),
    )
