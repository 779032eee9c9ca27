"""Mixed recipes (issue 41): a recipe's whole behaviour in a layer is its operand plan, one
:class:`~fp8train.spec.rule.QuantRule` per slot of each GEMM, so a mixture is a plan whose
slots come from several sources.

* :class:`HybridRecipe` (:func:`fp8train.spec.recipes.hybrid`): the output GEMM as one recipe quantizes it, the
  grad_input and grad_weight GEMMs as another (Transformer Engine's ``CustomRecipe`` example
  "FP8 current scaling forward, MXFP8 backward"). Each GEMM's two slots come from one
  recipe, so every pair multiplies; a slot reuses another's quantization (the forward's
  weight, transposed, in the backward) only where both rules are the same (the plan's own
  rule, :class:`~fp8train.spec.plan.OperandPlan`).
* :class:`SlotRecipe` (:func:`custom`): the user's own rule for each slot, checked when
  built: each GEMM's two slots quantized by rules whose granularities one hardware GEMM
  family multiplies (the grad_weight GEMM's may both be left out: high precision).

Delayed scaling mixes per direction: its slots keep their delayed scales (the module's amax
history per role, as :class:`~fp8train.spec.recipes.DelayedScaling` keeps it), the other
direction's slots scale as their own recipe does. A module keeps one history, so both
directions delayed must be one delayed recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Mapping

from .checks import ArgumentTypeError
from .formats import FloatFormat
from .granularities import GemmFamily
from .plan import Operand, OperandPlan
from .recipe_base import Recipe
from .roles import Gemm, Role, Usage
from .rule import QuantRule

__all__ = ["HybridRecipe", "SlotRecipe", "custom"]


def _check_direction(recipe: object, what: str) -> None:
    if not isinstance(recipe, Recipe):
        raise ArgumentTypeError(
            f"{what}={recipe!r} must be a Recipe; name recipes with fp8train.recipes.hybrid(forward=..., backward=...)"
        )


def _check_one_history(forward: Recipe, backward: Recipe) -> None:
    delayed = (forward.delayed_scaling, backward.delayed_scaling)
    if None not in delayed and delayed[0] != delayed[1]:
        raise ValueError(
            f"forward={delayed[0]!r} and backward={delayed[1]!r} are two delayed-scaling recipes, but a module "
            "keeps one amax history: give both directions the same delayed recipe, or one a current-scaling one"
        )


@dataclass(frozen=True, kw_only=True)
class HybridRecipe(Recipe):
    """The output GEMM as ``forward`` quantizes it, grad_input and grad_weight as ``backward``
    does (a GEMM one of them runs in high precision stays so).

    Attributes:
        forward: a :class:`Recipe`.
        backward: a :class:`Recipe` (where both are delayed scaling, the same one).
        labels: the two recipes' names for :meth:`describe` (not compared).

    Build one with :func:`fp8train.recipes.hybrid <fp8train.spec.recipes.hybrid>`, which
    takes names too.

    Raises:
        ValueError: two different delayed-scaling recipes.
        TypeError: ``forward`` or ``backward`` not a :class:`Recipe`.
    """

    forward: Recipe
    backward: Recipe
    labels: tuple[str, str] = field(default=("", ""), compare=False, repr=False)
    name: ClassVar[str] = "hybrid"

    def _validate(self) -> None:
        _check_direction(self.forward, "forward")
        _check_direction(self.backward, "backward")
        _check_one_history(self.forward, self.backward)

    def build_plan(self) -> OperandPlan:
        forward = [op for op in self.forward.operand_plan.operands if op.usage.gemm is Gemm.OUTPUT]
        backward = [op for op in self.backward.operand_plan.operands if op.usage.gemm is not Gemm.OUTPUT]
        return OperandPlan(operands=tuple(forward + backward))

    @property
    def delayed_scaling(self) -> Recipe | None:
        """The delayed direction's recipe (whose state the module keeps), or ``None``."""
        if not self.operand_plan.delayed:
            return None
        return self.forward.delayed_scaling or self.backward.delayed_scaling

    def role_format(self, role: Role | str) -> FloatFormat:
        """The input's and the weight's format as ``forward`` has them, grad_output's as
        ``backward`` does."""
        role = Role.coerce(role)
        return (self.forward if role.is_forward else self.backward).role_format(role)

    def describe(self) -> str:
        """``hybrid(forward=nvfp4,backward=mxfp8)``: how reports name it (``labels``: the
        two recipes' names, where :func:`~fp8train.spec.recipes.hybrid` was given names)."""
        forward, backward = (label or repr(recipe) for label, recipe in zip(self.labels, (self.forward, self.backward)))
        return f"hybrid(forward={forward},backward={backward})"


@dataclass(frozen=True, kw_only=True)
class SlotRecipe(Recipe):
    """A recipe of the user's own rule per operand slot (Transformer Engine's
    ``CustomRecipe``, per tensor role and GEMM).

    Attributes:
        rules: ``{slot: QuantRule}`` (a :class:`~fp8train.spec.roles.Usage` or its name,
            e.g. ``"OUTPUT_INPUT"``): the output and grad_input GEMMs' four slots, and the
            grad_weight GEMM's two or neither (it then runs in high precision).

    Raises:
        ValueError: a GEMM with one slot given and not the other; the output or grad_input
            GEMM without rules; two slots of a GEMM no hardware GEMM family multiplies; an
            unknown slot name.
        TypeError: a rule that is not a :class:`~fp8train.spec.rule.QuantRule`.
    """

    rules: Mapping[Usage | str, QuantRule] = field(default_factory=dict)
    name: ClassVar[str] = "custom"

    def _validate(self) -> None:
        rules = {}
        for slot, rule in dict(self.rules).items():
            usage = _usage(slot)
            if not isinstance(rule, QuantRule):
                raise ArgumentTypeError(f"rules[{usage.name}]={rule!r} must be a QuantRule (fp8train.spec.QuantRule)")
            rules[usage] = rule
        for gemm in Gemm:
            a, b = gemm.usages
            given = [usage for usage in (a, b) if usage in rules]
            if len(given) == 1:
                missing = b if given[0] is a else a
                raise ValueError(
                    f"the {gemm.value} GEMM has a rule for {given[0].name} but none for {missing.name}: give both "
                    "slots of a GEMM a rule, or neither (it then runs in high precision)"
                )
            if given:
                _check_pair(gemm, rules[a], rules[b])
            elif gemm is not Gemm.GRAD_WEIGHT:
                raise ValueError(
                    f"the {gemm.value} GEMM has no rules: give {a.name} and {b.name} one each (only the grad_weight "
                    "GEMM runs in high precision in an FP8 layer; keep a whole module in high precision with the "
                    "per-module recipe None)"
                )
        object.__setattr__(self, "rules", tuple(sorted(rules.items(), key=lambda item: list(Usage).index(item[0]))))

    def build_plan(self) -> OperandPlan:
        return OperandPlan(operands=tuple(Operand(usage=usage, rule=rule) for usage, rule in self.rules))

    def role_format(self, role: Role | str) -> FloatFormat:
        """The format of the role's first quantized slot (its data format in this recipe)."""
        role = Role.coerce(role)
        for usage, rule in self.rules:
            if usage.role is role:
                return rule.format
        return super().role_format(role)

    def describe(self) -> str:
        return "custom(" + ",".join(f"{usage.name.lower()}={rule.granularity}" for usage, rule in self.rules) + ")"


def _usage(slot: object) -> Usage:
    if isinstance(slot, Usage):
        return slot
    if isinstance(slot, str) and slot.upper() in Usage.__members__:
        return Usage[slot.upper()]
    valid = ", ".join(Usage.__members__)
    raise ValueError(f"unknown operand slot {slot!r}; the slots are {valid}")


def _check_pair(gemm: Gemm, a: QuantRule, b: QuantRule) -> None:
    try:
        GemmFamily.of(a.granularity, b.granularity)
    except NotImplementedError:
        raise ValueError(
            f"the {gemm.value} GEMM cannot multiply {str(a.granularity)!r} ({gemm.usages[0].name}) with "
            f"{str(b.granularity)!r} ({gemm.usages[1].name}): no GEMM family takes both; give its two slots "
            "granularities of one recipe family (tensor/row, block, mx, nvfp4 or mxfp4)"
        ) from None


def custom(rules: Mapping[Usage | str, QuantRule]) -> SlotRecipe:
    """A recipe of one :class:`~fp8train.spec.rule.QuantRule` per operand slot (see
    :class:`SlotRecipe`), checked when built."""
    return SlotRecipe(rules=rules)
