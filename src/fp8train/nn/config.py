"""``Float8ModuleConfig``: the options every FP8 module takes, as one value.

A converted module's recipe, GEMM backend and whether it keeps its input for the backward
in FP8 travel together from :func:`fp8train.convert_to_float8_training` through the
converters to each module's constructor (as torchao's ``Float8LinearConfig`` does); they
are checked once, here, and the recipe is resolved from its name here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from ..quant.gemm import BACKENDS
from ..spec.checks import check_bool, check_choice
from ..spec.hash_once import state_without_hash
from ..spec.recipes import Recipe, recipe_label, resolve_recipe

__all__ = ["Float8ModuleConfig", "ConfigOption", "DEFAULT_RECIPE", "DEFAULT_BACKEND"]

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
            :class:`~fp8train.nn.modules.linear.Float8Linear`); same results either way.

    Raises:
        ValueError: an unknown recipe name or backend.
        TypeError: ``recipe`` neither a Recipe nor a name; ``save_fp8_activations`` not a bool.
    """

    recipe: Recipe | str = DEFAULT_RECIPE
    backend: str = DEFAULT_BACKEND
    save_fp8_activations: bool = True

    # A module keeps its last LinearCall here (Float8Module._linear_call, issue 38), under a
    # MEMO_PREFIX key: pickling and copying leave it out (its kernels hold a thread's launch).
    __getstate__ = state_without_hash

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", resolve_recipe(self.recipe))
        check_choice("backend", self.backend, BACKENDS)
        check_bool("save_fp8_activations", self.save_fp8_activations)

    def describe(self) -> str:
        """The options as an FP8 module's ``repr`` shows them."""
        return f"recipe={recipe_label(self.recipe)}, backend={self.backend}, save_fp8_activations={self.save_fp8_activations}"

    @classmethod
    def build(cls, config: "Float8ModuleConfig | None" = None, **options: object) -> "Float8ModuleConfig":
        """The one place a module's options become a config: ``config`` where given, else a
        config of ``options`` (``recipe=``, ``backend=``, ``save_fp8_activations=``; one that
        is ``None`` takes its default). The FP8 modules' constructors and ``from_*`` pass
        their ``recipe=`` shorthand here, :func:`fp8train.convert_to_float8_training` its
        three option keywords; an option at its default value beside a ``config`` counts as
        not given.

        Raises:
            TypeError: ``config`` is not a ``Float8ModuleConfig``, or is given beside an
                option (the message names both and the fix).
        """
        given = {name: value for name, value in options.items() if value is not None}
        if config is None:
            return cls(**given)
        if not isinstance(config, Float8ModuleConfig):
            raise TypeError(f"config={config!r} must be a Float8ModuleConfig or None")
        defaults = {f.name: f.default for f in fields(cls)}
        clashing = [
            f"{name}={value!r}" for name, value in given.items()
            if not (type(value) is type(defaults[name]) and value == defaults[name])
        ]
        if clashing:
            listed = ", ".join(clashing)
            raise TypeError(
                f"{listed} given beside config={config!r}: pass the options in one place, "
                f"config=dataclasses.replace(config, {listed}), or leave config out"
            )
        return config


class ConfigOption:
    """A module attribute that reads the field of the same name of the module's
    ``fp8_config`` (a :class:`Float8ModuleConfig`); assigning it replaces the config by one
    with that field changed, checked as any config is."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, module: object, owner: type | None = None) -> object:
        return self if module is None else getattr(module.fp8_config, self.name)

    def __set__(self, module: object, value: object) -> None:
        module.fp8_config = dataclasses.replace(module.fp8_config, **{self.name: value})
