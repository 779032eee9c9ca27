"""``fp8train.autocast``: turn FP8 off, or override the recipe, for converted modules.

State lives in one place: a thread-local holding the innermost autocast's settings and
the delayed-scaling modules that ran inside the outermost one. The context manager
snapshots it, sets it, and restores it in ``finally``. A thread-local rather than a
``contextvars.ContextVar``: ``torch.compile`` traces an attribute read (and guards on what
it read) but breaks the graph at ``ContextVar.get``, which every converted module's
forward would call. Each thread sees its own state, as with a context variable (a new
thread, such as the autograd engine's device threads, starts with none).

The thread-local holds each setting as its own plain attribute (a bool, a recipe or
``None``, a group or ``None``, a list or ``None``), and :func:`current_state` builds the
:class:`AutocastState` from them at each call. So a compiled forward's guards are on those
values (a changed setting fails one and recompiles), never on a state object's type or
identity: torch 2.10/2.11 failed to build such a guard ("Unexpected type ...AutocastState").
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from ..spec.checks import ArgumentTypeError
from ..spec.recipes import Recipe, resolve_recipe
from .delayed.amax import reduction_active
from .delayed.reduction import end_step

__all__ = ["autocast", "AutocastState", "current_state", "HELD"]


@dataclass(frozen=True, kw_only=True)
class AutocastState:
    """Settings of the innermost active :func:`autocast`.

    Attributes:
        enabled: FP8 on (``True``) or off for converted modules.
        recipe: Recipe overriding the modules' own, or ``None``.
        amax_reduction_group: Process group for delayed scaling's amax all-reduce.
        pending: Modules whose delayed-scaling state trained since the outermost autocast
            began (:meth:`~fp8train.nn.delayed.state.DelayedScalingState.begin_forward`); their
            forward tensors are updated when it exits. Shared by nested autocasts.
    """

    enabled: bool = True
    recipe: Recipe | None = None
    amax_reduction_group: object | None = None
    pending: list = field(default_factory=list)


class _ThreadState(threading.local):
    """Per thread: the innermost active autocast's settings, one plain attribute each
    (``pending`` is ``None`` outside any autocast).

    Set in ``__init__`` (which ``threading.local`` runs once in each thread that reads
    them), never as class attributes: Dynamo looks an attribute up with
    ``inspect.getattr_static`` first, which sees a class attribute and not the thread's
    value, and torch 2.10/2.11 then trace and guard the class's default in its place.
    """

    def __init__(self) -> None:
        self.hold(None)

    def hold(self, state: AutocastState | None) -> None:
        """Hold ``state``'s settings, and ``state`` itself as ``held`` (``None``: outside any
        autocast)."""
        self.held: AutocastState | None = state
        self.enabled: bool = True if state is None else state.enabled
        self.recipe: Recipe | None = None if state is None else state.recipe
        self.amax_reduction_group: object | None = None if state is None else state.amax_reduction_group
        self.pending: list | None = None if state is None else state.pending


_STATE = _ThreadState()

HELD = _STATE
"""This thread's held settings: ``HELD.held`` is the innermost autocast's state itself, or
``None``, read without a call (issue 38) where ``torch.compile`` does not trace (a traced
caller takes :func:`current_state`, which builds one from the plain values)."""


def current_state() -> AutocastState | None:
    """The innermost active autocast's state, or ``None`` outside any autocast."""
    if _STATE.pending is None:
        return None
    return AutocastState(
        enabled=_STATE.enabled,
        recipe=_STATE.recipe,
        amax_reduction_group=_STATE.amax_reduction_group,
        pending=_STATE.pending,
    )


def _nested(outer: AutocastState | None, enabled: bool, recipe, amax_reduction_group) -> AutocastState:
    """The state of an autocast inside ``outer``: the settings given, the rest inherited."""
    return AutocastState(
        enabled=enabled,
        recipe=recipe if recipe is not None else (outer.recipe if outer else None),
        amax_reduction_group=amax_reduction_group
        if amax_reduction_group is not None
        else (outer.amax_reduction_group if outer else None),
        pending=outer.pending if outer else [],
    )


def autocast(
    enabled: bool = True,
    recipe: Recipe | str | None = None,
    amax_reduction_group: object | None = None,
) -> contextlib.AbstractContextManager[AutocastState]:
    """Control FP8 for the converted modules run inside the block.

    ``enabled=False`` runs converted modules as plain ``nn.Linear`` (e.g. to evaluate in
    high precision); ``recipe`` overrides their recipe. Autocasts nest: an inner one
    replaces the settings it is given and inherits the rest, and the outer settings come
    back on exit, also when the block raises.

    Delayed scaling: modules record their amaxes during the forward pass; the forward
    tensors (input, weight) of every module that ran are rescaled and their histories
    rolled when the *outermost* autocast exits (after an all-reduce over
    ``amax_reduction_group`` when the recipe's ``reduce_amax`` is on; a block that raises
    in a distributed run skips that collective and leaves its amaxes to the next step's
    update, so one failing rank cannot hang the others). grad_output is
    updated during backward, right after it is quantized (distributed: once for all
    modules, in one all-reduce, when the backward pass ends). Modules whose forward
    ``torch.compile`` traced update their input and weight scales right after their
    backward instead (same numbers; see :meth:`fp8train.nn.delayed.state.DelayedScalingState.defer_until_backward`):
    keep the autocast outside the compiled region, as the trainer does.

    Args:
        enabled: turn FP8 on or off.
        recipe: a :class:`~fp8train.spec.recipes.Recipe` or a recipe name, or ``None`` to keep
            each module's own (or the enclosing autocast's override).
        amax_reduction_group: ``torch.distributed`` process group for amax reduction;
            ``None`` inherits the enclosing autocast's (default: the whole world).

    Raises:
        TypeError: if ``enabled`` is not a bool.
        ValueError: for an unknown recipe name.
    """
    if enabled is not True and enabled is not False:  # (not isinstance: no call, issue 38)
        raise TypeError(f"enabled={enabled!r} must be True or False")
    if recipe is not None and not isinstance(recipe, (str, Recipe)):
        raise ArgumentTypeError(f"recipe={recipe!r} must be a Recipe, a recipe name or None")
    if recipe is not None:
        recipe = resolve_recipe(recipe)
    block = _AutocastBlock()  # (its settings set here, no __init__: a call less, issue 38)
    block._settings = (enabled, recipe, amax_reduction_group)
    return block


class _AutocastBlock(contextlib.ContextDecorator):
    """The block :func:`autocast` returns (also a decorator, as a generator's context manager
    is): entering nests its settings in the enclosing autocast's and holds them; leaving
    restores those, and the outermost one ends delayed scaling's step. A class rather than
    ``contextlib.contextmanager``, whose generator cost ten calls more a step (issue 38)."""

    # Set by autocast() (no __init__ of its own: a call less each step, issue 38).
    _settings: tuple = (True, None, None)  # (enabled, recipe, amax_reduction_group)
    _outer: AutocastState | None = None
    _state: AutocastState | None = None

    def _recreate_cm(self) -> "_AutocastBlock":
        block = _AutocastBlock()  # a decorated function's every call: a block of its own
        block._settings = self._settings
        return block

    def __enter__(self) -> AutocastState:
        # (current_state's own test first: no call outside any autocast; traced too, so not HELD)
        self._outer = outer = None if _STATE.pending is None else current_state()
        if outer is None:  # the outermost: the settings as given, nothing to inherit (a call less)
            enabled, recipe, group = self._settings
            state = AutocastState(enabled=enabled, recipe=recipe, amax_reduction_group=group)
        else:
            state = _nested(outer, *self._settings)
        thread = _STATE  # (hold(state), inline here and below: a call less each, issue 38)
        thread.held, thread.enabled, thread.recipe = state, state.enabled, state.recipe
        thread.amax_reduction_group, thread.pending = state.amax_reduction_group, state.pending
        self._state = state
        return state

    def __exit__(self, exc_type, exc, traceback) -> None:
        outer, state, thread = self._outer, self._state, _STATE
        if outer is None:
            thread.held = thread.recipe = thread.amax_reduction_group = thread.pending = None
            thread.enabled = True
        else:
            thread.hold(outer)
        if outer is None and (state.pending or reduction_active(state.amax_reduction_group)):
            owners, state.pending[:] = list(state.pending), []
            end_step(owners, state.amax_reduction_group, exc_type is not None)
