"""The 4-bit recipes: NVFP4 (Transformer Engine's ``NVFP4BlockScaling``) and MXFP4.

Both quantize every operand of the three GEMMs to E2M1 (NUMERICS.md 6); they differ in the
scaling groups and in the options a slot's :class:`~fp8train.spec.rule.QuantRule` carries.
The names of the modules that run them (``Float8Linear`` ...) predate 4 bits: they run
whichever recipe they are given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .checks import check_bool
from .formats import E2M1, FloatFormat, Format
from .granularities import Granularity
from .plan import Operand, OperandPlan
from .recipe_base import Recipe
from .roles import Gemm, Role, Usage
from .rule import MX_SCALE_RULES, QuantRule

__all__ = ["NVFP4Scaling", "MXFP4Scaling"]


class _FP4Recipe(Recipe):
    """What the two 4-bit recipes share: E2M1 data in every role, and an ``fp8_format``
    that can only be ``E4M3`` (the field exists for every recipe; no operand is FP8)."""

    def role_format(self, role: Role | str) -> FloatFormat:
        """E2M1: every role's data is 4-bit."""
        Role.coerce(role)
        return E2M1

    def _check_fp8_format(self) -> None:
        if self.fp8_format is not Format.E4M3:
            raise ValueError(
                f"fp8_format={self.fp8_format.name} is not an option of the {self.name} recipe: every operand "
                "is 4-bit E2M1; leave fp8_format at its default (E4M3)"
            )


@dataclass(frozen=True, kw_only=True)
class NVFP4Scaling(_FP4Recipe):
    """NVFP4 training, as Transformer Engine's ``NVFP4BlockScaling`` with its defaults.

    The plan (NUMERICS.md 6): the output GEMM takes the input in 1x16 groups (round to
    nearest even) and the weight in 16x16 tiles; grad_input takes grad_output in 1x16 groups
    with stochastic rounding and the weight's same tiles, transposed; grad_weight takes
    grad_output and the input in 1x16 groups along the token dim, both through the random
    Hadamard transform, grad_output rounded stochastically. Stochastic rounding draws from
    PyTorch's default generator of the tensor's device (``torch.manual_seed`` seeds it; the
    trainer's checkpoints keep its state).

    Attributes:
        fp8_format: only ``E4M3`` (no operand is FP8; see :class:`_FP4Recipe`).
        disable_rht: no Hadamard transform on the grad_weight operands (TE's
            ``disable_rht``: needed there on consumer Blackwell, sm_120).
        disable_stochastic_rounding: round grad_output to nearest even too.
        disable_2d_quantization: quantize the weight in 1x16 groups (along K for the
            output GEMM, along the output dim for grad_input) instead of 16x16 tiles.
    """

    fp8_format: Format = Format.E4M3
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    name: ClassVar[str] = "nvfp4"

    def _validate(self) -> None:
        self._check_fp8_format()
        for option in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            check_bool(option, getattr(self, option))

    def build_plan(self) -> OperandPlan:
        weight = Granularity.NVFP4 if self.disable_2d_quantization else Granularity.NVFP4_2D
        rht, sr = not self.disable_rht, not self.disable_stochastic_rounding
        rules = {
            Usage.OUTPUT_INPUT: QuantRule(granularity=Granularity.NVFP4),
            Usage.OUTPUT_WEIGHT: QuantRule(granularity=weight),
            Usage.GRAD_INPUT_GRAD_OUTPUT: QuantRule(granularity=Granularity.NVFP4, stochastic_rounding=sr),
            Usage.GRAD_INPUT_WEIGHT: QuantRule(granularity=weight),
            Usage.GRAD_WEIGHT_GRAD_OUTPUT: QuantRule(granularity=Granularity.NVFP4, rht=rht, stochastic_rounding=sr),
            Usage.GRAD_WEIGHT_INPUT: QuantRule(granularity=Granularity.NVFP4, rht=rht),
        }
        return OperandPlan(operands=tuple(Operand(usage=u, rule=rules[u]) for gemm in Gemm for u in gemm.usages))


@dataclass(frozen=True, kw_only=True)
class MXFP4Scaling(_FP4Recipe):
    """MXFP4 training: every operand in 1x32 groups along its GEMM's contraction dim, E2M1
    data, one E8M0 scale per group (the MXFP8 rule with 6 for 448), round to nearest even.

    Attributes:
        fp8_format: only ``E4M3`` (no operand is FP8).
        scale_rule: ``"ceil"`` (default, never saturates) or ``"ocp"``, as :class:`MXFP8Scaling`.
    """

    fp8_format: Format = Format.E4M3
    scale_rule: str = "ceil"
    block_size: ClassVar[int] = Granularity.MXFP4.block
    name: ClassVar[str] = "mxfp4"

    def _validate(self) -> None:
        self._check_fp8_format()
        if self.scale_rule not in MX_SCALE_RULES:
            raise ValueError(f"scale_rule={self.scale_rule!r} must be one of {', '.join(MX_SCALE_RULES)}")

    def build_plan(self) -> OperandPlan:
        return self.plan_from_roles(Granularity.MXFP4, power_2_scales=True, mx_scale_rule=self.scale_rule)
