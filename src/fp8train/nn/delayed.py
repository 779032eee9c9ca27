"""Delayed-scaling state of converted modules: recording amaxes and the batched update.

Each module using :class:`~fp8train.spec.recipes.DelayedScaling` owns two buffers, one
column per quantized tensor (:attr:`Role.index <fp8train.spec.roles.Role.index>`: input,
weight, grad_output):

* ``fp8_scale``: float32 ``(3,)``, initialised to 1;
* ``fp8_amax_history``: float32 ``(amax_history_len, 3)``, initialised to 0; row 0 holds
  the amax recorded in the current step.

A module holding many such states at once (the experts of an MoE layer,
:mod:`fp8train.nn.experts`) may add leading dims ``S``: ``fp8_scale`` ``(*S, 3)`` and
``fp8_amax_history`` ``(amax_history_len, *S, 3)``; each element is updated on its own.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Iterable, Protocol

import torch

from ..quant.scaling import delayed_scaling_update
from ..spec.recipes import DelayedScaling
from ..spec.roles import Role
from .amax import all_reduce_max, reduction_active

__all__ = [
    "DelayedScalingOwner",
    "NUM_ROLES",
    "FORWARD_ROLES",
    "GRAD_OUTPUT_ROLES",
    "fp8_max_per_role",
    "update_delayed_tensors",
    "register",
    "schedule_forward_update",
    "defer_forward_update",
    "reducing_modules",
    "step_end_update",
    "grad_output_flush",
]

NUM_ROLES = len(Role)
FORWARD_ROLES = slice(Role.INPUT.index, Role.GRAD_OUTPUT.index)
"""Columns of the forward roles (input, weight), updated at the outermost autocast's exit."""
GRAD_OUTPUT_ROLES = slice(Role.GRAD_OUTPUT.index, Role.GRAD_OUTPUT.index + 1)
"""Column of grad_output, updated when its backward has used it."""


class DelayedScalingOwner(Protocol):
    """What a module (or any holder) of delayed-scaling state declares.

    Attributes:
        fp8_scale: float32 ``(NUM_ROLES,)``, or ``(*S, NUM_ROLES)`` for a batch of states.
        fp8_amax_history: float32 ``(amax_history_len, NUM_ROLES)``, or
            ``(amax_history_len, *S, NUM_ROLES)``.
        delayed_recipe: the :class:`DelayedScaling` recipe the state follows.
        fp8_registry_key: its place in the batched reduction (``None`` until registered).
    """

    fp8_scale: torch.Tensor
    fp8_amax_history: torch.Tensor
    delayed_recipe: DelayedScaling
    fp8_registry_key: int | None


def fp8_max_per_role(recipe: DelayedScaling, device: torch.device | None = None) -> torch.Tensor:
    """Largest finite value of each role's format, float32 ``(NUM_ROLES,)``."""
    return torch.tensor([recipe.role_format(role).max for role in Role], dtype=torch.float32, device=device)


def update_delayed_tensors(modules: Iterable[DelayedScalingOwner], roles: slice) -> None:
    """Rescale and roll the delayed-scaling state of ``roles`` of every module (local: the
    current amaxes are already reduced where they should be).

    Args:
        modules: modules owning ``fp8_scale``, ``fp8_amax_history`` and ``delayed_recipe``.
        roles: the columns to update (forward roles, grad_output, or all).
    """
    for module in modules:
        recipe = module.delayed_recipe
        fp8_max = fp8_max_per_role(recipe, module.fp8_scale.device)[roles]
        delayed_scaling_update(
            module.fp8_amax_history[..., roles],
            module.fp8_scale[..., roles],
            fp8_max,
            margin=recipe.margin,
            algo=recipe.amax_compute_algo,
        )


# Every module with delayed-scaling state, in the order of their first forward. The batched all-reduce covers
# all of them on every rank, in this order, so the collective matches across ranks even
# when some modules did not run on some rank (they contribute zero amaxes).
_REGISTRY: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_REGISTRATION_ORDER = itertools.count()


def register(module: DelayedScalingOwner) -> None:
    """Add ``module`` (owning delayed-scaling state) to the batched amax reduction, once.

    Modules register at their first forward, so the first step must run every module on
    every rank (as Transformer Engine requires); later steps may skip modules anywhere.
    Under ``torch.compile`` (which cannot trace the weak registry: a graph break in every
    forward) this is a no-op, and the outermost ``fp8train.autocast``'s exit registers the
    modules that ran, in the order they ran: the same order, in eager code.
    """
    if torch.compiler.is_compiling():
        return
    key = module.fp8_registry_key
    if key is not None and _REGISTRY.get(key) is module:  # (a deepcopy carries a stale key)
        return
    module.fp8_registry_key = next(_REGISTRATION_ORDER)
    _REGISTRY[module.fp8_registry_key] = module


def schedule_forward_update(owner: DelayedScalingOwner, state: object | None) -> None:
    """At a forward of ``owner``: register it, apply a forward update still pending from a
    forward run outside any ``fp8train.autocast``, and (with grad) schedule this one's.

    Inside an autocast the update waits for the outermost one's exit (``state.pending``);
    outside, it happens at ``owner``'s next forward. ``owner`` also declares
    ``fp8_forward_pending: bool``. A forward without grad only reads the state.

    Args:
        owner: the module holding the state.
        state: the innermost ``fp8train.autocast``'s state (anything with ``pending``,
            a list), or ``None`` outside any autocast.
    """
    register(owner)  # at its first forward: the order every rank's amax all-reduce follows
    owner.fp8_forward_traced = torch.compiler.is_compiling()  # see defer_forward_update
    if owner.fp8_forward_pending and (state is None or owner not in state.pending):
        with torch.no_grad():
            update_delayed_tensors([owner], FORWARD_ROLES)
        owner.fp8_forward_pending = owner.fp8_update_after_backward = False
    if not owner.fp8_forward_pending and torch.is_grad_enabled():
        owner.fp8_forward_pending = True
        if state is not None:
            state.pending.append(owner)


def reducing_modules() -> list[torch.nn.Module]:
    """Registered live modules whose recipe reduces amaxes, in registration order."""
    modules = [_REGISTRY.get(key) for key in sorted(_REGISTRY.keys())]
    return [m for m in modules if m is not None and m.delayed_recipe.reduce_amax]


def _reduce_and_update(pending: list[torch.nn.Module], roles: slice, group: object | None) -> None:
    """Single process: rescale and roll ``roles`` of the ``pending`` modules. Distributed:
    one all-reduce (MAX) of ``roles`` over every registered reducing module, then every
    tensor that ran on some rank is rescaled and rolled, identically on every rank."""
    with torch.no_grad():
        if reduction_active(group):
            modules = reducing_modules()
            # A module that did not run on a rank contributes its zero amax.
            all_reduce_max([m.fp8_amax_history[0, ..., roles] for m in modules], group)
            update_delayed_tensors(modules, roles)
            reduced = set(map(id, modules))
            pending = [m for m in pending if id(m) not in reduced]
        update_delayed_tensors(pending, roles)


def step_end_update(pending: list[torch.nn.Module], group: object | None) -> None:
    """The forward-tensor update at the exit of the outermost ``fp8train.autocast``."""
    _reduce_and_update(pending, FORWARD_ROLES, group)


def defer_forward_update(module: torch.nn.Module, group: object | None) -> bool:
    """At the outermost ``fp8train.autocast``'s exit: whether ``module``'s forward update
    waits until its backward has run (``True``; arranged here) rather than happening now.

    It waits where ``torch.compile`` traced the module's forward (which
    :func:`schedule_forward_update` records) and so its backward: the compiled backward
    holds the buffers as saved tensors, records grad_output's amax and updates its column,
    and writes the buffers back whole, from what it saved. An update in place between the
    two (at this exit) would trip autograd's check on saved tensors, and be overwritten.
    The module updates instead right after its backward (a hook on a parameter that gets a
    gradient) or, without one, at its next forward, as outside any autocast: the same
    numbers, since nothing reads the input's and weight's scales in between. Not where the
    recipe reduces amaxes across processes: that backward queues a collective, which
    ``torch.compile`` runs eagerly (with its Function), and the exit's update is the batched one.
    """
    if not getattr(module, "fp8_forward_traced", False):
        return False
    if module.delayed_recipe.reduce_amax and reduction_active(group):
        return False
    module.fp8_update_after_backward = True
    _hook_after_backward(module)
    return True


def _hook_after_backward(module: torch.nn.Module) -> None:
    """Make the backward of ``module`` apply its deferred forward update (a hook on a
    parameter that gets a gradient; once: a copy of the module, whose parameters are new,
    hooks its own)."""
    param = next((p for p in module.parameters() if p.requires_grad), None)
    if param is None or getattr(module, "_fp8_hooked_parameter_id", None) == id(param):
        return
    module_ref = weakref.ref(module)

    def update_after_backward(_: torch.Tensor) -> None:
        # Not where compiled autograd traces the hook into the backward's graph, whose
        # write-back of the saved buffers follows it: there the next forward updates.
        if torch.compiler.is_compiling():
            return
        owner = module_ref()
        if owner is not None and getattr(owner, "fp8_update_after_backward", False):
            with torch.no_grad():
                update_delayed_tensors([owner], FORWARD_ROLES)
            owner.fp8_forward_pending = owner.fp8_update_after_backward = False

    param.register_post_accumulate_grad_hook(update_after_backward)
    module._fp8_hooked_parameter_id = id(param)  # an int: the module still pickles


class _GradOutputFlush:
    """Reduces and applies grad_output amaxes once, at the end of the backward pass.

    Distributed, a module's grad_output amax cannot be applied in its own backward (that
    would be one collective per module, and a module skipped on one rank would hang the
    others); it is queued to run once, batched, when the autograd engine finishes.
    """

    def __init__(self) -> None:
        self.queued = False

    def queue(self, group: object | None) -> None:
        if self.queued:
            return
        self.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._run(group))

    def _run(self, group: object | None) -> None:
        self.queued = False
        _reduce_and_update([], GRAD_OUTPUT_ROLES, group)


grad_output_flush = _GradOutputFlush()
