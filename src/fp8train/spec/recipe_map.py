"""A recipe per module (issue 41): an ordered list of module-name patterns, each with the
recipe its modules run or ``None`` (high precision). The first pattern that matches a
module's qualified name wins; a module no pattern matches stays in high precision.

Patterns are shell-style (:mod:`fnmatch`, matched against the whole qualified name):
``"layers.*.attn.*"``, ``"*.mlp.*"``, ``"lm_head"``, ``"*"`` for the rest. For example
attention projections in MXFP8, MLPs and experts in NVFP4, the head in bf16::

    {"*.attn.*": "mxfp8", "*.mlp.*": "nvfp4", "*.experts": "nvfp4", "lm_head": None}

The one-line form (``fp8train train --recipe``, a config file's string) is the same pairs
joined: ``"*.attn.*=mxfp8;*.mlp.*=nvfp4;lm_head=bf16"`` (``bf16`` or ``none``: high precision).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from .checks import ArgumentTypeError
from .recipe_base import Recipe
from .recipes import from_name, recipe_label, resolve_recipe

__all__ = ["RecipeMap", "recipe_map", "is_recipe_map", "recipe_or_map", "recipes_of", "HIGH_PRECISION_NAMES"]

HIGH_PRECISION_NAMES = ("bf16", "none", "high_precision")
"""What the one-line form calls high precision (a mapping takes ``None`` too)."""


@dataclass(frozen=True)
class RecipeMap:
    """Module-name patterns and their recipes, in order.

    Attributes:
        entries: ``((pattern, recipe or None), ...)``; validated by :func:`recipe_map`.
        labels: each entry's recipe as given (a name, or the recipe's description), for reports.
    """

    entries: tuple[tuple[str, Recipe | None], ...]
    labels: tuple[str, ...]

    def match(self, fqn: str) -> tuple[int, Recipe | None] | None:
        """``(entry index, recipe or None)`` of the first pattern ``fqn`` matches; ``None``
        where none does."""
        for index, (pattern, recipe) in enumerate(self.entries):
            if fnmatch.fnmatchcase(fqn, pattern):
                return index, recipe
        return None

    @property
    def recipes(self) -> tuple[Recipe, ...]:
        """The distinct recipes it runs, in order of their first pattern."""
        found = []
        for _, recipe in self.entries:
            if recipe is not None and recipe not in found:
                found.append(recipe)
        return tuple(found)

    def describe(self) -> str:
        """The one-line form: ``"*.attn.*=mxfp8;*.mlp.*=nvfp4;lm_head=bf16"``."""
        return ";".join(f"{pattern}={label}" for (pattern, _), label in zip(self.entries, self.labels))


def _pairs(value: object) -> list[tuple[object, object]]:
    """The (pattern, recipe) pairs of a mapping, a list of pairs or the one-line form."""
    if isinstance(value, str):
        pairs = []
        for item in filter(None, (part.strip() for part in value.split(";"))):
            pattern, sep, name = item.partition("=")  # a name may hold "=": hybrid(forward=...)
            if not sep or not pattern:
                raise ValueError(f"recipe map entry {item!r} is not pattern=recipe (e.g. '*.mlp.*=nvfp4')")
            pairs.append((pattern.strip(), name.strip()))
        return pairs
    if isinstance(value, (dict, tuple, list)):  # a dict keeps its order (OrderedDict too)
        items = list(value.items()) if isinstance(value, dict) else list(value)
        if not all(isinstance(item, (tuple, list)) and len(item) == 2 for item in items):
            raise ArgumentTypeError(f"a recipe map list holds (pattern, recipe) pairs; got {value!r}")
        return [tuple(item) for item in items]
    if isinstance(value, Mapping) or isinstance(value, (set, frozenset)):
        raise ArgumentTypeError(
            f"a recipe map must be ordered (the first pattern that matches wins): a dict or a list of "
            f"(pattern, recipe) pairs, not a {type(value).__name__}"
        )
    raise ArgumentTypeError(f"recipe map {value!r} must be a dict, a list of (pattern, recipe) pairs or a string")


def recipe_map(value: object) -> RecipeMap:
    """``value`` (a dict of pattern to recipe, a list of pairs, or the one-line form) as a
    :class:`RecipeMap`.

    Raises:
        ValueError: an empty map, an empty or repeated pattern, an unknown recipe name (the
            message names the pattern).
        TypeError: a mapping that is not ordered (a set), a pattern that is not a string, a
            recipe that is neither a recipe nor a name nor ``None``.
    """
    entries, labels = [], []
    for pattern, value_recipe in _pairs(value):
        if not isinstance(pattern, str) or not pattern.strip():
            raise ArgumentTypeError(f"recipe map pattern {pattern!r} must be a non-empty string")
        if any(pattern == seen for seen, _ in entries):
            raise ValueError(f"recipe map pattern {pattern!r} is given twice; each pattern once")
        high = value_recipe is None or (isinstance(value_recipe, str) and value_recipe.strip().lower() in HIGH_PRECISION_NAMES)
        try:
            recipe = None if high else resolve_recipe(value_recipe)
        except (TypeError, ValueError) as error:
            raise type(error)(f"recipe map pattern {pattern!r}: {error}") from None
        entries.append((pattern, recipe))
        labels.append("bf16" if recipe is None else recipe_label(recipe, value_recipe))
    if not entries:
        raise ValueError("a recipe map needs at least one pattern (e.g. {'*': 'mxfp8'})")
    return RecipeMap(tuple(entries), tuple(labels))


def is_recipe_map(value: object) -> bool:
    """Whether ``value`` asks for a recipe per module: a mapping, a list or tuple of pairs,
    a set (refused by :func:`recipe_map` as unordered), or the one-line form (a string with
    ``=`` outside a ``hybrid(...)`` name)."""
    if isinstance(value, str):
        return "=" in value and not value.strip().lower().startswith("hybrid(")
    return isinstance(value, (Mapping, list, tuple, set, frozenset))


def recipe_or_map(text: str) -> "Recipe | RecipeMap":
    """A recipe name (``hybrid(...)`` included) or the one-line map form, as the trainer's
    ``fp8_recipe`` takes it: the recipe, or the :class:`RecipeMap`.

    Raises:
        ValueError, TypeError: as :func:`~fp8train.spec.recipes.from_name` or :func:`recipe_map`.
    """
    return recipe_map(text) if is_recipe_map(text) else from_name(text)


def recipes_of(value: "Recipe | RecipeMap") -> tuple[Recipe, ...]:
    """The recipes a recipe or a map runs."""
    return value.recipes if isinstance(value, RecipeMap) else (value,)
