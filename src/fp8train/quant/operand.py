"""The quantization of an operand slot: a high-precision tensor quantized as a recipe's
:class:`~fp8train.spec.plan.OperandPlan` says for one slot (:class:`~fp8train.spec.roles.Usage`),
as the K-last operand its GEMM takes.

A slot's last-dim usage is quantized with ``axis=-1``, its first-dim usage with ``axis=0``
and transposed, or, where the plan allows (symmetric granularities), as the transpose of
the last-dim quantization. The autograd of the FP8 modules
(:mod:`fp8train.nn.function`) and the weights stored in FP8 (:mod:`fp8train.nn.weights`)
quantize their slots through these, so a stored weight holds the bits a forward would make.
"""

from __future__ import annotations

import torch

from ..spec.plan import Operand, OperandPlan
from ..spec.roles import LAST_DIM, Usage
from .quantize import quantize, quantize_both_in_one_read
from .tensor import QuantizedTensor, transpose

__all__ = ["quantize_operand", "quantize_usage", "quantize_both_usages"]


def quantize_operand(op: Operand, t_hp: torch.Tensor, scale: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize ``t_hp`` by the rule of the slot ``op``, in ``t_hp``'s orientation.

    Args:
        op: the slot's :class:`~fp8train.spec.plan.Operand` (its usage's axis, its rule).
        t_hp: the high-precision tensor of ``op.role``.
        scale: the delayed-scaling scale of the role, or ``None``.
    """
    return quantize(t_hp, op.rule, axis=op.axis, scale=scale)


def quantize_usage(
    plan: OperandPlan,
    usage: Usage,
    t_hp: torch.Tensor,
    scale: torch.Tensor | None = None,
    last_dim: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """The K-last operand of ``usage`` from the high-precision tensor ``t_hp``.

    Args:
        plan: the recipe's operand plan.
        usage: the slot; a first-dim usage comes back transposed.
        t_hp: the tensor of ``usage.role``, 2-D.
        scale: the delayed-scaling scale of the role, or ``None``.
        last_dim: the role's last-dim quantization, which a first-dim usage reuses (as its
            transpose) where the plan allows.
    """
    if last_dim is not None and plan.reuses_last_dim(usage):
        return transpose(last_dim)
    qt = quantize_operand(plan.operand(usage), t_hp, scale)
    return qt if usage.axis == LAST_DIM else transpose(qt)


def quantize_both_usages(
    plan: OperandPlan, last: Usage, first: Usage, t_hp: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The K-last operands of one role's last-dim usage ``last`` and first-dim usage
    ``first``, as two :func:`quantize_usage` calls give them. Where the plan quantizes the
    two by the same rule, from one read of ``t_hp`` if a kernel here does that
    (:func:`~fp8train.quant.quantize.quantize_both_in_one_read`: on a GPU, writing the
    first-dim operand in the layout its GEMM takes); else by the two calls (the first
    reusing the last-dim quantization where the plan allows)."""
    rule, first_rule = plan.operand(last).rule, plan.operand(first).rule
    if first_rule is rule or first_rule == rule:  # identity first: no __eq__ call
        both = quantize_both_in_one_read(t_hp, rule, scale=scale)
        if both is not None:
            return both[0], transpose(both[1])
    last_qt = quantize_usage(plan, last, t_hp, scale)
    return last_qt, quantize_usage(plan, first, t_hp, scale, last_qt)
