"""Scaling recipes: frozen, validated descriptions of how each operand is quantized.

Build one by name with :func:`from_name`, or construct a dataclass directly to change
its fields. Every invalid combination raises ``ValueError`` naming the field at
construction time, so nothing downstream has to re-check. Each recipe declares its
:class:`~fp8train.spec.plan.OperandPlan` (built once, at construction): the rest of the
library reads the plan, never the recipe's type.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Callable, ClassVar

from .checks import ArgumentTypeError, check_bool, check_int
from .formats import Format
from .fp4_recipes import MXFP4Scaling, NVFP4Scaling
from .granularities import Granularity
from .plan import OperandPlan
from .recipe_base import AmaxComputeAlgo, Recipe, check_epsilon
from .roles import Gemm, Role, Usage
from .rule import MX_SCALE_RULES
from .hash_once import hash_once, state_without_hash
from .mixed_recipes import HybridRecipe, SlotRecipe, custom

__all__ = [
    "Recipe",
    "TensorwiseScaling",
    "DelayedScaling",
    "RowwiseScaling",
    "BlockScaling",
    "MXFP8Scaling",
    "NVFP4Scaling",
    "MXFP4Scaling",
    "HybridRecipe",
    "SlotRecipe",
    "hybrid",
    "custom",
    "RECIPE_NAMES",
    "from_name",
    "resolve_recipe",
    "recipe_label",
]

@dataclass(frozen=True, kw_only=True)
class TensorwiseScaling(Recipe):
    """Current scaling: one float32 scale per tensor from that tensor's own amax.

    Attributes:
        fp8_format: ``HYBRID`` (default) or ``E4M3``.
        power_2_scales: Round every scale down to a power of two.
        amax_epsilon: Lower bound applied to the amax before computing the scale.
    """

    fp8_format: Format = Format.HYBRID
    power_2_scales: bool = False
    amax_epsilon: float = 0.0
    name: ClassVar[str] = "tensorwise"

    def _validate(self) -> None:
        check_bool("power_2_scales", self.power_2_scales)
        check_epsilon(self.amax_epsilon)

    def build_plan(self) -> OperandPlan:
        return self.plan_from_roles(Granularity.TENSOR, power_2_scales=self.power_2_scales, amax_epsilon=self.amax_epsilon)


@dataclass(frozen=True, kw_only=True)
class DelayedScaling(Recipe):
    """Delayed scaling: one float32 scale per tensor from a history of amaxes.

    Attributes:
        fp8_format: ``HYBRID`` (default) or ``E4M3``.
        margin: The scale is divided by ``2**margin`` (headroom for growing values).
        amax_history_len: Number of amaxes kept per tensor (>= 1).
        amax_compute_algo: ``"max"`` over the history, ``"most_recent"``, or a callable
            that maps an ``amax_history`` of shape ``(L, ...)`` to the amax of shape ``(...)``.
        reduce_amax: All-reduce (MAX) the current amaxes across the process group.
    """

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    reduce_amax: bool = True
    name: ClassVar[str] = "delayed"

    __hash__ = hash_once  # its state's per-recipe caches are asked every step (issue 38)
    __getstate__ = state_without_hash

    def _validate(self) -> None:
        check_int("margin", self.margin, minimum=0)
        check_int("amax_history_len", self.amax_history_len, minimum=1)
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo={self.amax_compute_algo!r} must be 'max', 'most_recent' "
                "or a callable mapping amax_history to an amax"
            )
        check_bool("reduce_amax", self.reduce_amax)

    def build_plan(self) -> OperandPlan:
        return self.plan_from_roles(Granularity.TENSOR, power_2_scales=False, delayed=True)


@dataclass(frozen=True, kw_only=True)
class RowwiseScaling(Recipe):
    """Axiswise scaling: one scale per row along each GEMM's contraction dim.

    Attributes:
        fp8_format: ``E4M3`` (default) or ``HYBRID``.
        grad_weight_hp: Keep the grad_weight GEMM in high precision and give the weight
            one per-tensor scale in the grad_input GEMM (the ``rowwise_with_gw_hp`` recipe).
        power_2_scales: Round every scale down to a power of two (default on).
        amax_epsilon: Lower bound applied to the amax before computing the scale.
    """

    fp8_format: Format = Format.E4M3
    grad_weight_hp: bool = False
    power_2_scales: bool = True
    amax_epsilon: float = 0.0

    @property
    def name(self) -> str:  # type: ignore[override]
        return "rowwise_with_gw_hp" if self.grad_weight_hp else "rowwise"

    def _validate(self) -> None:
        check_bool("grad_weight_hp", self.grad_weight_hp)
        check_bool("power_2_scales", self.power_2_scales)
        check_epsilon(self.amax_epsilon)

    def build_plan(self) -> OperandPlan:
        # With the grad_weight GEMM in high precision, the weight's columnwise usage takes
        # one per-tensor scale instead of one per column.
        return self.plan_from_roles(
            Granularity.ROW,
            power_2_scales=self.power_2_scales,
            amax_epsilon=self.amax_epsilon,
            overrides={Usage.GRAD_INPUT_WEIGHT: Granularity.TENSOR} if self.grad_weight_hp else None,
            high_precision=(Gemm.GRAD_WEIGHT,) if self.grad_weight_hp else (),
        )


@dataclass(frozen=True, kw_only=True)
class BlockScaling(Recipe):
    """Blockwise scaling (DeepSeek-V3 style): one float32 scale per 1x128 or 128x128 block.

    Attributes:
        fp8_format: ``E4M3`` (default) or ``HYBRID``.
        x_block_scaling_dim: 1 (1x128 blocks, default) or 2 (128x128 tiles) for the input.
        w_block_scaling_dim: 1 or 2 (default) for the weight.
        grad_block_scaling_dim: 1 (default) or 2 for grad_output.
        power_2_scales: Round every scale down to a power of two (default on).
        amax_epsilon: Lower bound applied to the amax before computing the scale.

    At most one operand of each GEMM may use 2-D blocks.
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scales: bool = True
    amax_epsilon: float = 0.0
    block_size: ClassVar[int] = Granularity.BLOCK_1X128.block
    name: ClassVar[str] = "blockwise"

    def _validate(self) -> None:
        dims = {
            "x_block_scaling_dim": self.x_block_scaling_dim,
            "w_block_scaling_dim": self.w_block_scaling_dim,
            "grad_block_scaling_dim": self.grad_block_scaling_dim,
        }
        for field_name, value in dims.items():
            if type(value) is not int or value not in (1, 2):
                raise ValueError(f"{field_name}={value!r} must be 1 (1x128 blocks) or 2 (128x128 tiles)")
        # The three GEMMs pair (x, w), (grad, w) and (grad, x).
        for a, b in (
            ("x_block_scaling_dim", "w_block_scaling_dim"),
            ("grad_block_scaling_dim", "w_block_scaling_dim"),
            ("grad_block_scaling_dim", "x_block_scaling_dim"),
        ):
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(
                    f"{a}=2 with {b}=2 makes a 2-D x 2-D block GEMM, which is not supported; "
                    f"set one of them to 1"
                )
        check_bool("power_2_scales", self.power_2_scales)
        check_epsilon(self.amax_epsilon)

    def build_plan(self) -> OperandPlan:
        return self.plan_from_roles(
            {role: self.granularity(role) for role in Role},
            power_2_scales=self.power_2_scales,
            amax_epsilon=self.amax_epsilon,
        )

    def granularity(self, role: Role | str) -> Granularity:
        """Granularity of ``role`` (a :class:`Role` or ``"input"``, ``"weight"``, ``"grad_output"``)."""
        dim = {
            Role.INPUT: self.x_block_scaling_dim,
            Role.WEIGHT: self.w_block_scaling_dim,
            Role.GRAD_OUTPUT: self.grad_block_scaling_dim,
        }[Role.coerce(role)]
        return Granularity.BLOCK_128X128 if dim == 2 else Granularity.BLOCK_1X128


@dataclass(frozen=True, kw_only=True)
class MXFP8Scaling(Recipe):
    """MXFP8: one E8M0 (power-of-two) scale per 32 consecutive values, 1-D blocks only.

    Attributes:
        fp8_format: ``E4M3`` (default) or ``HYBRID``.
        scale_rule: ``"ceil"`` (default, never saturates: ``e = ceil(log2(amax/fp8_max))``)
            or ``"ocp"`` (the OCP MX spec's ``floor(log2(amax)) - emax``, which may saturate).
    """

    fp8_format: Format = Format.E4M3
    scale_rule: str = "ceil"
    block_size: ClassVar[int] = Granularity.MX.block
    name: ClassVar[str] = "mxfp8"

    def _validate(self) -> None:
        if self.scale_rule not in MX_SCALE_RULES:
            raise ValueError(f"scale_rule={self.scale_rule!r} must be one of {', '.join(MX_SCALE_RULES)}")

    def build_plan(self) -> OperandPlan:
        return self.plan_from_roles(Granularity.MX, power_2_scales=True, mx_scale_rule=self.scale_rule)


_FACTORIES: dict[str, Callable[[], Recipe]] = {
    "tensorwise": TensorwiseScaling,
    "current": TensorwiseScaling,
    "delayed": DelayedScaling,
    "rowwise": RowwiseScaling,
    "rowwise_with_gw_hp": lambda: RowwiseScaling(grad_weight_hp=True),
    "blockwise": BlockScaling,
    "mxfp8": MXFP8Scaling,
    "nvfp4": NVFP4Scaling,
    "mxfp4": MXFP4Scaling,
}
RECIPE_NAMES = tuple(name for name in _FACTORIES if name != "current")
"""The canonical recipe names (``"current"`` is also accepted as an alias of ``"tensorwise"``)."""


def resolve_recipe(recipe: "Recipe | str") -> Recipe:
    """``recipe`` itself, or the recipe named by it (see :func:`from_name`).

    Raises:
        TypeError: neither a :class:`Recipe` nor a string.
        ValueError: an unknown name.
    """
    if isinstance(recipe, str):
        return from_name(recipe)
    if not isinstance(recipe, Recipe):
        raise ArgumentTypeError(
            f"recipe={recipe!r} must be a Recipe or a recipe name ({', '.join(RECIPE_NAMES)})"
        )
    return recipe


def from_name(name: str) -> Recipe:
    """The recipe with its default fields named ``name`` (one shared instance per name: recipes
    are frozen values).

    Args:
        name: one of ``tensorwise`` (alias ``current``), ``delayed``, ``rowwise``,
            ``rowwise_with_gw_hp``, ``blockwise``, ``mxfp8``, and the 4-bit ``nvfp4`` and
            ``mxfp4``; or a mixture of two, ``hybrid(forward=NAME,backward=NAME)``
            (:func:`hybrid`). Case-insensitive.

    Raises:
        ValueError: for an unknown name; the message lists the valid ones.
        TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"unknown FP8 recipe {name!r}: a recipe name is a string; valid names: {', '.join(RECIPE_NAMES)} "
            "(or 'current')"
        )
    key = "".join(name.split()).lower()
    if key.startswith("hybrid(") and key.endswith(")"):
        return _hybrid_from_text(key)
    if key not in _FACTORIES:
        raise ValueError(
            f"unknown FP8 recipe {name!r}; valid names: {', '.join(RECIPE_NAMES)} (or 'current')"
        )
    return _named_recipe(key)


@functools.cache
def _hybrid_from_text(key: str) -> "HybridRecipe":
    """``hybrid(forward=nvfp4,backward=mxfp8)`` (the form reports and the CLI use)."""
    fields = dict(part.partition("=")[::2] for part in key[len("hybrid(") : -1].split(","))
    if set(fields) != {"forward", "backward"}:
        raise ValueError(f"{key!r} must name both directions and nothing else: hybrid(forward=NAME,backward=NAME)")
    return hybrid(forward=fields["forward"], backward=fields["backward"])


@functools.cache
def _named_recipe(key: str) -> Recipe:
    """One recipe per name (recipes are frozen values): every layer converted by name shares
    its plan and rules, so the caches keyed by them (issue 38) find them by identity."""
    return _FACTORIES[key]()


def hybrid(*, forward: "Recipe | str", backward: "Recipe | str") -> HybridRecipe:
    """A recipe whose output GEMM follows ``forward`` and whose grad_input and grad_weight
    GEMMs follow ``backward`` (each a recipe or its name), e.g.
    ``hybrid(forward="nvfp4", backward="mxfp8")`` (:class:`~fp8train.spec.mixed_recipes.HybridRecipe`).

    Raises:
        ValueError: an unknown name, or two different delayed-scaling recipes.
        TypeError: neither a recipe nor a name.
    """
    recipes = []
    for what, value in (("forward", forward), ("backward", backward)):
        try:
            recipes.append(resolve_recipe(value))
        except (TypeError, ValueError) as error:
            raise type(error)(f"{what}: {error}") from None
    labels = tuple(recipe_label(recipe, value) for value, recipe in zip((forward, backward), recipes))
    return HybridRecipe(forward=recipes[0], backward=recipes[1], labels=labels)


def recipe_label(recipe: Recipe, given: object = None) -> str:
    """How reports name ``recipe``: the name it was ``given`` by (compacted, lower case), a
    mixture's description, the name of the built-in recipe it equals, its class's ``name``,
    else its ``repr``."""
    if isinstance(given, str):
        return "".join(given.split()).lower()
    describe = getattr(recipe, "describe", None)
    if describe is not None:
        return describe()
    named = next((name for name in RECIPE_NAMES if from_name(name) == recipe), None)
    return named or recipe.name or repr(recipe)
