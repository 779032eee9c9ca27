"""A role's quantizer (:class:`RoleQuantizer`: its two usages, who quantizes them, the GEMM
operand values a kernel writes in its pass) and the checked doors of a plan's operands
(:func:`quantize_operand`, :func:`quantize_usage`, :func:`quantize_both_usages`); the
package's docstring (:mod:`fp8train.quant.operand`) says how they fit."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ...spec.plan import Operand, OperandPlan
from ...spec.roles import LAST_DIM, Role, Usage
from ...spec.rule import QuantRule
from ..cast import HIGH_PRECISION_DTYPES
from ..gemm import emulated_gemm_dtype
from ..kernels.fp4 import transpose_with_values
from ..kernels.fp8 import reads_both_at_once
from ..quantize import no_one_read, bound_quantizers, quantize, quantize_both_in_one_read
from ..tensor import QuantizedTensor, transpose

__all__ = [
    "quantize_operand", "quantize_usage", "quantize_both_usages", "RoleQuantizer", "ROLE_USAGES",
    "checked_role_quantizer", "bound_role_quantizers",
]

ROLE_USAGES = {
    Role.INPUT: (Usage.OUTPUT_INPUT, Usage.GRAD_WEIGHT_INPUT),
    Role.WEIGHT: (Usage.OUTPUT_WEIGHT, Usage.GRAD_INPUT_WEIGHT),
    Role.GRAD_OUTPUT: (Usage.GRAD_INPUT_GRAD_OUTPUT, Usage.GRAD_WEIGHT_GRAD_OUTPUT),
}
"""Each role's ``(last-dim usage, first-dim usage)``."""


def _checked_quantize(x, rule: QuantRule, axis: int, scale) -> QuantizedTensor:
    return quantize(x, rule, axis=axis, scale=scale)


def _checked_both(x, rule: QuantRule, scale):
    return quantize_both_in_one_read(x, rule, scale=scale)


@dataclass(frozen=True, eq=False)
class RoleQuantizer:
    """How one role's high-precision tensor becomes the K-last operands of its two usages,
    decided once per plan (and, bound, per device type).

    Attributes:
        last_rule: the last-dim usage's rule (``None``: that GEMM runs in high precision).
        first_rule: the first-dim usage's rule (``None``: that GEMM runs in high precision).
        first_axis: the axis the first-dim usage is quantized along: 0, or -1 for a rule
            with no axis (:attr:`~fp8train.spec.rule.QuantRule.axis_free`), as the door
            normalizes it.
        reuse: the first-dim usage is the last-dim quantization transposed (the plan's
            :meth:`~fp8train.spec.plan.OperandPlan.reuses_last_dim`).
        one_read: both usages take one rule (and one scale source), so a kernel may read the
            tensor once for both (not where ``quantize_both`` never does: no call, issue 38).
        last_delayed, first_delayed: the usage takes the delayed scale it is given
            (:attr:`~fp8train.spec.plan.Operand.delayed`); one that does not (a mixture's
            current-scaled direction) computes its own, whatever scale it is given.
        quantize: ``(x, rule, axis, scale)`` to the :class:`QuantizedTensor`, or ``None``
            where it leaves ``x`` to ``reference``.
        quantize_both: ``(x, rule, scale)`` to both usages from one read, or ``None``.
        reference: what serves a tensor ``quantize`` leaves (``None``: it leaves none).
        last_values, first_values: the dtype the kernel writes the usage's GEMM operand in,
            in its pass, per input dtype (``quantize``'s ``values``: the CPU's kernels,
            :func:`bound_role_quantizers`); ``None``: the GEMM converts the codes itself.
        both_values: both usages' operand dtypes per input dtype, for ``quantize_both``.
        reuse_transpose: ``last`` to the reused transpose with its GEMM operand (the CPU's
            4-bit kernel, where ``first_values`` has one dtype), or ``None``: the transpose.
        quantize_pair: a kernel's ``(x, last_rule, first_rule, first_axis, gemm_values)``
            to both usages from one read, each by its own rule (or ``None`` where it leaves
            ``x``), where both usages are quantized, neither reuses the other and neither
            takes a given scale; else ``None``.
        pair_values: which usages of ``quantize_pair`` also hold the emulated GEMM's
            operand values: both but the input's first-dim one, which the forward saves
            for the backward without them.
        folds_amax: :meth:`last` and :meth:`both` take an ``amax`` element to fold ``max|x|`` into
            in the cast's read (delayed scaling's record: the CPU's FP8 kernels' delayed usage).
    """

    last_rule: QuantRule | None
    first_rule: QuantRule | None
    first_axis: int
    reuse: bool
    one_read: bool
    quantize: Callable[..., QuantizedTensor | None]
    quantize_both: Callable[..., tuple[QuantizedTensor, QuantizedTensor] | None]
    reference: Callable[..., QuantizedTensor] | None = None
    last_delayed: bool = False
    first_delayed: bool = False
    last_values: dict | None = None
    first_values: dict | None = None
    both_values: dict | None = None
    reuse_transpose: Callable[..., QuantizedTensor] | None = None
    quantize_pair: Callable[..., tuple[QuantizedTensor, QuantizedTensor] | None] | None = None
    pair_values: tuple[bool, bool] = (True, True)
    folds_amax: bool = False

    @classmethod
    def of(
        cls, plan: OperandPlan, role: Role, quantize, quantize_both, reference=None, quantize_pair=None
    ) -> "RoleQuantizer":
        """The role's choices under ``plan``, quantizing through the given functions."""
        last, first = ROLE_USAGES[role]
        last_op = plan.operand(last) if plan.quantizes_usage(last) else None
        first_op = plan.operand(first) if plan.quantizes_usage(first) else None
        last_rule = None if last_op is None else last_op.rule
        first_rule = None if first_op is None else first_op.rule
        last_delayed = last_op is not None and last_op.delayed
        first_delayed = first_op is not None and first_op.delayed
        reuse = plan.reuses_last_dim(first)
        pairs = last_rule is not None and first_rule is not None and not (reuse or last_delayed or first_delayed)
        return cls(
            last_rule=last_rule,
            first_rule=first_rule,
            first_axis=-1 if first_rule is not None and first_rule.axis_free else 0,
            reuse=reuse,
            one_read=last_rule is not None and first_rule == last_rule and first_delayed == last_delayed and quantize_both is not no_one_read,
            quantize=quantize,
            quantize_both=quantize_both,
            reference=reference,
            last_delayed=last_delayed,
            first_delayed=first_delayed,
            quantize_pair=quantize_pair if pairs else None,
            pair_values=(True, role is not Role.INPUT),
        )

    def last(self, x: torch.Tensor, scale: torch.Tensor | None, amax=None) -> QuantizedTensor:
        """The last-dim usage's K-last operand of ``x`` (``scale``: the role's delayed scale, or
        ``None``; ``amax``: where :attr:`folds_amax`, the element to fold ``max|x|`` into, or ``None``)."""
        rule, scale, values = self.last_rule, scale if self.last_delayed else None, self.last_values
        if values is None:
            qt = self.quantize(x, rule, -1, scale)
        elif amax is None:  # (the 4-bit kernel may leave x to the reference, which writes no values)
            qt = self.quantize(x, rule, -1, scale, values=values[x.dtype])
        else:  # (folds_amax: the FP8 kernel, which serves every tensor, folds the amax into its read)
            return self.quantize(x, rule, -1, scale, values=values[x.dtype], amax=amax)
        return self.reference(x, rule, -1, scale) if qt is None else qt

    def first(
        self, x: torch.Tensor, scale: torch.Tensor | None, last: QuantizedTensor | None = None
    ) -> QuantizedTensor:
        """The first-dim usage's K-last operand of ``x``: ``last`` (the last-dim
        quantization) transposed where the plan reuses it, else its own, transposed."""
        if last is not None and self.reuse:  # (x: None where the caller has last only)
            return transpose(last) if self.reuse_transpose is None else self.reuse_transpose(last)
        rule, axis, scale, values = self.first_rule, self.first_axis, scale if self.first_delayed else None, self.first_values
        qt = self.quantize(x, rule, axis, scale) if values is None else self.quantize(x, rule, axis, scale, values=values[x.dtype])
        return transpose(self.reference(x, rule, axis, scale) if qt is None else qt)

    def both(self, x: torch.Tensor, scale: torch.Tensor | None, amax=None) -> tuple[QuantizedTensor, QuantizedTensor]:
        """Both usages' K-last operands, as :meth:`last` and :meth:`first` give them: from
        one read of ``x`` where a kernel does that for their rules, else two quantizations
        (the second the first transposed, where the plan reuses it)."""
        if self.quantize_pair is not None:
            both = self.quantize_pair(x, self.last_rule, self.first_rule, self.first_axis, self.pair_values)
            if both is not None:
                return both[0], transpose(both[1])
        if self.one_read:
            given, values = scale if self.last_delayed else None, self.both_values
            if values is None:
                both = self.quantize_both(x, self.last_rule, given)
            else:
                both = self.quantize_both(x, self.last_rule, given, values=values[x.dtype])
            if both is not None:
                return both[0], transpose(both[1])
        last = self.last(x, scale, amax)  # (folds_amax: neither one read nor a pair above)
        return last, self.first(x, scale, last)


@functools.lru_cache(maxsize=64)
def _checked_role_quantizer(plan: OperandPlan, role: Role) -> RoleQuantizer:
    return RoleQuantizer.of(plan, role, _checked_quantize, _checked_both)


def checked_role_quantizer(plan: OperandPlan, role: Role) -> RoleQuantizer:
    """``role``'s quantizer under ``plan`` through the checked door, for any tensor (cached,
    except while ``torch.compile`` traces, where a cache's wrapper makes Dynamo warn)."""
    if torch.compiler.is_compiling():
        return _checked_role_quantizer.__wrapped__(plan, role)
    return _checked_role_quantizer(plan, role)


def bound_role_quantizers(plan: OperandPlan, device_type: str) -> tuple[RoleQuantizer, ...] | None:
    """The input's, the weight's and grad_output's quantizers (in :class:`Role` order)
    under ``plan``, bound to the quantizers of its format family on ``device_type``
    (:func:`~fp8train.quant.quantize.bound_quantizers`), for tensors the caller has checked
    once: plain tensors of a high-precision dtype on ``device_type``, not empty, outside
    ``torch.compile``. ``None`` for a plan of two format families (each has its own door)."""
    families = {op.granularity.data_bits for op in plan.operands}
    if len(families) != 1:
        return None
    data_bits = families.pop()
    kernel, kernel_both, reference, kernel_pair = bound_quantizers(data_bits, device_type)
    roles = tuple(RoleQuantizer.of(plan, role, kernel, kernel_both, reference, kernel_pair) for role in ROLE_USAGES)
    if device_type != "cpu" or (data_bits != 8 and reference is None):
        return roles
    # The CPU's kernels (FP8 and 4-bit), or the FP8 reference there (reference None), write
    # each GEMM operand in their pass (issue 38).
    return tuple(_with_operand_values(plan, q, u, reference is not None) for q, u in zip(roles, ROLE_USAGES.values()))


def _with_operand_values(plan: OperandPlan, quantizer: RoleQuantizer, usages: tuple[Usage, Usage], kernel: bool) -> RoleQuantizer:
    """``quantizer`` asking its kernel (``kernel``), or the reference, for each usage's GEMM operand (:func:`_operand_values`)."""
    last, first = (_operand_values(plan, usage) for usage in usages)
    # No quantize_both call where it reads no tensor once (the reference: one call) for the
    # rule, or a scale is given (4-bit: the CPU kernel has none).
    granularity = quantizer.last_rule.granularity if quantizer.one_read and not quantizer.last_delayed else None
    one_read = granularity is not None and not granularity.fp4
    one_read = one_read and (reads_both_at_once(granularity) if kernel else not granularity.symmetric)
    if last is None and first is None:
        return dataclasses.replace(quantizer, one_read=one_read)
    both = {dtype: (last and last[dtype], first and first[dtype]) for dtype in HIGH_PRECISION_DTYPES}
    fp4_reuse = quantizer.reuse and first is not None and quantizer.last_rule.granularity.fp4 and len(set(first.values())) == 1
    reuse_transpose = functools.partial(transpose_with_values, values=first[torch.float32]) if fp4_reuse else None
    folds = kernel and last is not None and quantizer.last_delayed  # (a delayed usage takes no pair, no one read)
    return dataclasses.replace(
        quantizer, one_read=one_read, last_values=last, first_values=first, both_values=both, reuse_transpose=reuse_transpose, folds_amax=folds
    )


def _operand_values(plan: OperandPlan, usage: Usage) -> dict | None:
    """The dtype the CPU's kernels write ``usage``'s GEMM operand in, per input dtype (a
    bound layer's output dtype too), as the emulated GEMM converts the codes
    (:func:`~fp8train.quant.gemm.emulated.emulated_mm`: bfloat16 where both operands fold
    and the GEMM runs in bfloat16, else float32; 4-bit block scales fold, but NVFP4's alpha
    keeps its GEMM in float32). ``None`` where the kernel writes none: a GEMM in high
    precision; the input's grad_weight operand (saved for the backward, which keeps its
    codes only); FP8 scales the GEMM neither folds nor applies to its output as one scale
    (a GEMM over blocks that do not fold runs per chunk of K, from the codes)."""
    if usage is Usage.GRAD_WEIGHT_INPUT or not plan.quantizes(usage.gemm):
        return None
    a, b = (plan.operand(u) for u in usage.gemm.usages)
    folds, op = a.computed_power_2_scales and b.computed_power_2_scales, plan.operand(usage)  # 4-bit: MXFP4's
    fp8_blocks = not folds and (a.granularity.block or b.granularity.block)  # (4-bit blocks always fold)
    if not op.granularity.fp4 and (not (op.computed_power_2_scales or op.granularity.per_tensor) or fp8_blocks):
        return None
    bf16 = torch.bfloat16 if folds and emulated_gemm_dtype("cpu") == torch.bfloat16 else torch.float32
    return {torch.float32: torch.float32, torch.float16: torch.float32, torch.bfloat16: bf16}


def quantize_operand(op: Operand, t_hp: torch.Tensor, scale: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize ``t_hp`` by the rule of the slot ``op``, in ``t_hp``'s orientation.

    Args:
        op: the slot's :class:`~fp8train.spec.plan.Operand` (its usage's axis, its rule).
        t_hp: the high-precision tensor of ``op.role``.
        scale: the delayed-scaling scale of the role, or ``None``.
    """
    return quantize(t_hp, op.rule, axis=op.axis, scale=scale)


def quantize_usage(
    plan: OperandPlan, usage: Usage, t_hp: torch.Tensor, scale: torch.Tensor | None = None, last_dim: QuantizedTensor | None = None
) -> QuantizedTensor:
    """The K-last operand of ``usage`` from the high-precision tensor ``t_hp``.

    Args:
        plan: the recipe's operand plan.
        usage: the slot; a first-dim usage comes back transposed.
        t_hp: the tensor of ``usage.role``, 2-D.
        scale: the delayed-scaling scale of the role, or ``None``.
        last_dim: the role's last-dim quantization, which a first-dim usage reuses (as its
            transpose) where the plan allows.

    Raises:
        KeyError: ``usage`` belongs to a GEMM the plan runs in high precision.
    """
    op = plan.operand(usage)  # raises for a GEMM in high precision
    role = checked_role_quantizer(plan, op.role)
    return role.last(t_hp, scale) if usage.axis == LAST_DIM else role.first(t_hp, scale, last_dim)


def quantize_both_usages(
    plan: OperandPlan, last: Usage, first: Usage, t_hp: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The K-last operands of one role's last-dim usage ``last`` and first-dim usage
    ``first``, as two :func:`quantize_usage` calls give them. Where the plan quantizes the
    two by the same rule, from one read of ``t_hp`` if a kernel here does that
    (:func:`~fp8train.quant.quantize.quantize_both_in_one_read`: on a GPU, writing the
    first-dim operand in the layout its GEMM takes); else by the two calls (the first
    reusing the last-dim quantization where the plan allows)."""
    plan.operand(last), plan.operand(first)  # raise for a GEMM in high precision
    return checked_role_quantizer(plan, last.role).both(t_hp, scale)
