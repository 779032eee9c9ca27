"""``Float8ModuleConfig``: the options every FP8 module takes, as one value.

A converted module's recipe, GEMM backend and whether it keeps its input for the backward
in FP8 travel together from :func:`fp8train.convert_to_float8_training` through the
converters to each module's constructor (as torchao's ``Float8LinearConfig`` does); they
are checked once, here, and the recipe is resolved from its name here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..quant.gemm import BACKENDS
from ..spec.checks import check_bool, check_choice
from ..spec.recipes import Recipe, resolve_recipe

__all__ = ["Float8ModuleConfig", "DEFAULT_RECIPE", "DEFAULT_BACKEND"]

DEFAULT_RECIPE = "tensorwise"
DEFAULT_BACKEND = "auto"


@dataclass(frozen=True, kw_only=True)
class Float8ModuleConfig:
    """How an FP8 module (``Float8Linear``, ``Float8Conv1D``, ``Float8MultiheadAttention``,
    ``Float8Experts``) runs its GEMMs.

    Attributes:
        recipe: a :class:`~fp8train.spec.recipes.Recipe`, or its name (resolved here: the
            attribute always holds the ``Recipe``).
        backend: ``"auto"``, ``"emulated"`` or ``"hardware"`` (see :func:`fp8train.quant.scaled_mm`).
        save_fp8_activations: keep the input for the backward as the grad_weight GEMM's FP8
            operand rather than in high precision (see
            :class:`~fp8train.nn.linear.Float8Linear`); same results either way.

    Raises:
        ValueError: an unknown recipe name or backend.
        TypeError: ``recipe`` neither a Recipe nor a name; ``save_fp8_activations`` not a bool.
    """

    recipe: Recipe | str = DEFAULT_RECIPE
    backend: str = DEFAULT_BACKEND
    save_fp8_activations: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", resolve_recipe(self.recipe))
        check_choice("backend", self.backend, BACKENDS)
        check_bool("save_fp8_activations", self.save_fp8_activations)

    @classmethod
    def of(
        cls,
        config: "Float8ModuleConfig | None",
        recipe: Recipe | str,
        backend: str,
        save_fp8_activations: bool,
    ) -> "Float8ModuleConfig":
        """``config`` where given (then the other arguments must be left at their
        defaults), else a config of the other arguments: what a constructor taking both
        forms builds.

        Raises:
            TypeError: ``config`` is not a ``Float8ModuleConfig``, or is given with options.
        """
        if config is None:
            return cls(recipe=recipe, backend=backend, save_fp8_activations=save_fp8_activations)
        if not isinstance(config, Float8ModuleConfig):
            raise TypeError(f"config={config!r} must be a Float8ModuleConfig or None")
        if not (recipe is DEFAULT_RECIPE and backend is DEFAULT_BACKEND and save_fp8_activations is True):
            raise TypeError(
                "pass the options either as config=Float8ModuleConfig(...) or as recipe=, backend=, "
                "save_fp8_activations=, not both"
            )
        return config
