"""Operand plans: what a recipe quantizes, how, for each operand slot of each GEMM.

A recipe's whole numerical behaviour in a Linear layer is its :class:`OperandPlan`; the
layer, the FSDP all-gather, the self-check and the trainer read the plan and never look
at the recipe's type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .formats import FloatFormat
from .granularities import Granularity
from .hash_once import hash_once, state_without_hash
from .rule import QuantRule
from .roles import FIRST_DIM, LAST_DIM, Gemm, Role, Usage

__all__ = ["Operand", "OperandPlan"]


@dataclass(frozen=True, kw_only=True)
class Operand:
    """One operand slot of one GEMM and how it is quantized.

    Attributes:
        usage: the slot (GEMM, role and the axis its scaling groups run along).
        rule: how the slot is quantized (granularity, format, scale rule).
        delayed: its per-tensor scale comes from its role's amax history (delayed scaling),
            not from the tensor being quantized.

    Raises:
        ValueError: ``delayed`` with a granularity that is not per-tensor.
    """

    usage: Usage
    rule: QuantRule
    delayed: bool = False

    def __post_init__(self) -> None:
        if self.delayed and not self.rule.granularity.per_tensor:
            raise ValueError(
                f"{self.usage.name}: delayed scaling takes one scale per tensor, not granularity "
                f"{str(self.rule.granularity)!r}"
            )

    @property
    def role(self) -> Role:
        """The tensor in this slot."""
        return self.usage.role

    @property
    def axis(self) -> int:
        """-1 (last-dim usage) or 0 (first-dim usage, transposed into the GEMM)."""
        return self.usage.axis

    @property
    def granularity(self) -> Granularity:
        """The rule's scaling groups."""
        return self.rule.granularity

    @property
    def format(self) -> FloatFormat:
        """The rule's FP8 data format."""
        return self.rule.format

    @property
    def power_2_scales(self) -> bool:
        """Whether the rule rounds scales down to powers of two (always, for E8M0)."""
        return self.rule.power_2_scales

    @property
    def computed_power_2_scales(self) -> bool:
        """Whether every scale of this slot is a power of two as the quantizer computes it:
        E8M0, or a power-of-two rule with no delayed scale given."""
        return self.rule.granularity.always_power_2 or (self.rule.power_2_scales and not self.delayed)

    def same_quantization(self, other: "Operand") -> bool:
        """Whether ``other`` quantizes the same tensor to the same codes and scales (the
        same role, by the same rule, its scale from the same source)."""
        return (self.role, self.rule, self.delayed) == (other.role, other.rule, other.delayed)


# The last-dim usage of each role: the slot its first-dim usage may reuse.
_LAST_DIM_USAGE = {
    Role.INPUT: Usage.OUTPUT_INPUT,
    Role.WEIGHT: Usage.OUTPUT_WEIGHT,
    Role.GRAD_OUTPUT: Usage.GRAD_INPUT_GRAD_OUTPUT,
}


@dataclass(frozen=True, kw_only=True)
class OperandPlan:
    """Every quantized operand slot of a Linear layer's three GEMMs.

    A GEMM without operands here runs in high precision.

    Attributes:
        operands: the quantized slots, one :class:`Operand` each, each with its rule and
            whether its scale is delayed.
        delayed: some slot's scale comes from an amax history (delayed scaling): the layer
            keeps that state (derived from ``operands``).
        delayed_roles: the roles with a delayed slot, whose amaxes the state records and
            whose columns it updates (derived).
    """

    operands: tuple[Operand, ...]
    delayed: bool = field(init=False, compare=False)
    delayed_roles: frozenset = field(init=False, repr=False, compare=False)
    # Lookups the layer makes on every forward and backward, derived once.
    _by_usage: dict = field(init=False, repr=False, compare=False)
    _reused: frozenset = field(init=False, repr=False, compare=False)
    _granularities: frozenset = field(init=False, repr=False, compare=False)
    _alignment: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_usage = {op.usage: op for op in self.operands}
        reused = frozenset(
            usage
            for usage, op in by_usage.items()
            if usage.axis == FIRST_DIM
            and op.granularity.symmetric
            and _LAST_DIM_USAGE[usage.role] in by_usage
            and op.same_quantization(by_usage[_LAST_DIM_USAGE[usage.role]])
        )
        object.__setattr__(self, "_by_usage", by_usage)
        object.__setattr__(self, "_reused", reused)
        object.__setattr__(self, "delayed_roles", frozenset(op.role for op in self.operands if op.delayed))
        object.__setattr__(self, "delayed", bool(self.delayed_roles))
        granularities = frozenset(op.granularity for op in self.operands)
        object.__setattr__(self, "_granularities", granularities)
        object.__setattr__(self, "_alignment", max((g.alignment for g in granularities), default=None))

    __hash__ = hash_once  # a layer's calls are cached by their plan (issue 38)
    __getstate__ = state_without_hash

    @classmethod
    def from_roles(
        cls,
        granularity: Mapping[Role, Granularity],
        formats: Mapping[Role, FloatFormat],
        *,
        power_2_scales: bool,
        overrides: Mapping[Usage, Granularity] | None = None,
        high_precision: tuple[Gemm, ...] = (),
        amax_epsilon: float = 0.0,
        mx_scale_rule: str = "ceil",
        delayed: bool = False,
    ) -> "OperandPlan":
        """A plan where each role has one granularity in every slot, except ``overrides``.

        Args:
            granularity: role -> granularity.
            formats: role -> FP8 format.
            power_2_scales: the recipe's choice (E8M0 granularities are always powers of two).
            overrides: slot -> granularity, where a slot differs from its role's.
            high_precision: GEMMs that are not quantized.
            amax_epsilon: every slot's amax floor (:attr:`QuantRule.amax_epsilon`).
            mx_scale_rule: every E8M0 slot's exponent rule (:attr:`QuantRule.mx_scale_rule`).
            delayed: every slot's per-tensor scale comes from an amax history.

        Raises:
            ValueError, TypeError: as :class:`~fp8train.spec.rule.QuantRule` for bad options.
        """
        overrides = overrides or {}
        operands = []
        for gemm in Gemm:
            if gemm in high_precision:
                continue
            for usage in gemm.usages:
                g = overrides.get(usage, granularity[usage.role])
                rule = QuantRule(
                    granularity=g,
                    format=formats[usage.role],
                    power_2_scales=power_2_scales or g.always_power_2,
                    amax_epsilon=amax_epsilon,
                    mx_scale_rule=mx_scale_rule,
                )
                operands.append(Operand(usage=usage, rule=rule, delayed=delayed))
        return cls(operands=tuple(operands))

    def operand(self, usage: Usage) -> Operand:
        """The :class:`Operand` in ``usage``.

        Raises:
            KeyError: ``usage`` belongs to a GEMM that runs in high precision.
        """
        op = self._by_usage.get(usage)
        if op is None:
            raise KeyError(f"{usage.name} is not quantized by this plan (its GEMM runs in high precision)")
        return op

    def quantizes(self, gemm: Gemm) -> bool:
        """Whether ``gemm`` runs in FP8 (else in high precision)."""
        return any(usage in self._by_usage for usage in gemm.usages)

    def quantizes_usage(self, usage: Usage) -> bool:
        """Whether ``usage`` is quantized."""
        return usage in self._by_usage

    def reuses_last_dim(self, usage: Usage) -> bool:
        """Whether the first-dim ``usage`` is the transpose of its role's last-dim
        quantization (one quantization serves both: a symmetric granularity under the same
        rule), rather than its own."""
        return usage in self._reused

    def usages_of(self, role: Role) -> tuple[Operand, ...]:
        """Every quantized slot of ``role``, last-dim usages first."""
        ops = [op for op in self.operands if op.role is role]
        return tuple(sorted(ops, key=lambda op: op.axis != LAST_DIM))

    @property
    def granularities(self) -> frozenset[Granularity]:
        """Every granularity the plan uses."""
        return self._granularities

    @property
    def alignment(self) -> int:
        """The multiple the GEMM dims (``in_features``, ``out_features`` and the token dim,
        which is zero-padded to it) need: the largest of the granularities' alignments."""
        if self._alignment is None:  # no quantized slot: max() says so
            return max(g.alignment for g in self._granularities)
        return self._alignment

    @property
    def block(self) -> int:
        """The block every quantized tensor must tile (0: none): a hard requirement."""
        return max(g.block for g in self.granularities)
