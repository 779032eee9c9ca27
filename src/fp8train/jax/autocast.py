"""``fp8train.jax.autocast``: turn FP8 off, or override the recipe, for the
:class:`~fp8train.jax.Dense` layers traced inside the block.

The state is read when a layer is *traced*, so enter the context inside the function you
``jax.jit`` (or around the first call that traces it): ``jax.jit`` caches a traced function
and does not see a context entered around a later call. One thread-local holds the
innermost context's settings; the context manager snapshots it, sets it and restores it in
``finally``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

from ..spec.checks import ArgumentTypeError
from ..spec.recipes import Recipe, resolve_recipe

__all__ = ["autocast", "AutocastState", "current_state"]


@dataclass(frozen=True, kw_only=True)
class AutocastState:
    """Settings of the innermost active :func:`autocast`.

    Attributes:
        enabled: FP8 on (``True``) or off (the layers run as ``flax.linen.Dense``).
        recipe: recipe overriding the layers' own, or ``None``.
    """

    enabled: bool = True
    recipe: Recipe | None = None


class _ThreadState(threading.local):
    current: AutocastState | None = None


_STATE = _ThreadState()


def current_state() -> AutocastState | None:
    """The innermost active autocast's settings, or ``None`` outside any."""
    return _STATE.current


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe: Recipe | str | None = None) -> Iterator[AutocastState]:
    """Control FP8 for the :class:`~fp8train.jax.Dense` layers traced inside the block, as
    :func:`fp8train.autocast` does for PyTorch modules.

    ``enabled=False`` runs them as plain ``flax.linen.Dense`` (e.g. to evaluate in high
    precision); ``recipe`` overrides their recipe. Contexts nest: an inner one replaces the
    settings it is given and inherits the rest.

    Args:
        enabled: turn FP8 on or off.
        recipe: a :class:`~fp8train.spec.recipes.Recipe` or a recipe name, or ``None`` to
            keep each layer's own (or the enclosing context's override).

    Raises:
        TypeError: ``enabled`` is not a bool, or ``recipe`` is neither a Recipe, a name nor None.
        ValueError: an unknown recipe name.
    """
    if not isinstance(enabled, bool):
        raise ArgumentTypeError(f"enabled={enabled!r} must be True or False")
    if recipe is not None and not isinstance(recipe, (str, Recipe)):
        raise ArgumentTypeError(f"recipe={recipe!r} must be a Recipe, a recipe name or None")
    outer = _STATE.current
    state = AutocastState(
        enabled=enabled,
        recipe=resolve_recipe(recipe) if recipe is not None else (outer.recipe if outer else None),
    )
    _STATE.current = state
    try:
        yield state
    finally:
        _STATE.current = outer
