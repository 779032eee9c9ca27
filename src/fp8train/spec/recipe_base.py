"""The :class:`Recipe` base class every recipe derives from (the FP8 recipes in
:mod:`fp8train.spec.recipes`, the 4-bit ones in :mod:`fp8train.spec.fp4_recipes`), and the
field checks they share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Union

from .checks import check_number
from .formats import FloatFormat, Format
from .granularities import Granularity
from .plan import OperandPlan
from .roles import Role

__all__ = ["AmaxComputeAlgo", "Recipe", "check_epsilon", "coerce_format"]

AmaxComputeAlgo = Union[str, Callable[[Any], Any]]
"""``"max"``, ``"most_recent"``, or a callable mapping an amax history tensor ``(L, ...)``
to the amax ``(...)`` (a tensor of the frontend in use)."""


def coerce_format(recipe: object, value: object) -> Format:
    if isinstance(value, Format):
        fmt = value
    elif isinstance(value, str) and value.upper() in Format.__members__:
        fmt = Format[value.upper()]
    else:
        valid = ", ".join(Format.__members__)
        raise ValueError(f"fp8_format={value!r} is not a Format; use one of {valid}")
    if fmt is Format.E5M2:
        raise ValueError(
            f"fp8_format=E5M2: pure E5M2 training is not supported by {type(recipe).__name__}; "
            "use Format.HYBRID (E5M2 only for grad_output) or Format.E4M3"
        )
    object.__setattr__(recipe, "fp8_format", fmt)
    return fmt


def check_epsilon(value: object) -> None:
    check_number("amax_epsilon", value, minimum=0, kind="a float")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base class of all recipes. ``name`` is the string :func:`from_name` accepts.

    Attributes:
        operand_plan: how every operand of every GEMM is quantized (derived from the
            other fields at construction; see :class:`~fp8train.spec.plan.OperandPlan`).
    """

    fp8_format: Format = Format.HYBRID
    operand_plan: OperandPlan = field(init=False, repr=False, compare=False)
    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        coerce_format(self, self.fp8_format)
        self._validate()
        object.__setattr__(self, "operand_plan", self.build_plan())

    def _validate(self) -> None:
        """Raise ``ValueError`` naming the field for invalid settings (subclasses extend)."""

    def build_plan(self) -> OperandPlan:
        """The recipe's :class:`~fp8train.spec.plan.OperandPlan`, from its (validated)
        fields. Every recipe defines it; it runs once, at construction."""
        raise NotImplementedError(
            f"{type(self).__name__} declares no operand plan: a Recipe subclass defines build_plan()"
        )

    def plan_from_roles(self, granularity: Granularity | dict, **kwargs) -> OperandPlan:
        """:meth:`OperandPlan.from_roles <fp8train.spec.plan.OperandPlan.from_roles>` with
        this recipe's formats, and ``granularity`` for every role or a dict per role."""
        if isinstance(granularity, Granularity):
            granularity = dict.fromkeys(Role, granularity)
        formats = {role: self.role_format(role) for role in Role}
        return OperandPlan.from_roles(granularity, formats, **kwargs)

    def role_format(self, role: Role | str) -> FloatFormat:
        """FP8 format of ``role``: the forward format for input and weight, the backward
        format for grad_output."""
        role = Role.coerce(role)
        return self.fp8_format.forward if role.is_forward else self.fp8_format.backward

    @property
    def delayed_scaling(self) -> "Recipe | None":
        """The delayed-scaling recipe whose amax history, margin and reduction drive this
        recipe's delayed slots (:attr:`Operand.delayed <fp8train.spec.plan.Operand.delayed>`):
        ``self`` where its plan has one, ``None`` where none; a mixture names its delayed part."""
        return self if self.operand_plan.delayed else None

    @property
    def keeps_head_in_high_precision(self) -> bool:
        """Whether a conversion keeps the model's output head in high precision by default
        (:mod:`fp8train.nn.head`): the 4-bit recipes, whose head in 4 bits ruins training
        (MXFP4's ended 43.6% above bf16 on a Llama); not the FP8 ones."""
        return any(granularity.fp4 for granularity in self.operand_plan.granularities)

    @property
    def alignment(self) -> int:
        """The multiple ``in_features`` and ``out_features`` need (16, the FP8 GEMM
        minimum; 128 blockwise; 32 MXFP8)."""
        return self.operand_plan.alignment
