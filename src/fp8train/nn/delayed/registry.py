"""The registry of every live delayed-scaling state, and what a backward's end owes them.

A step's amax all-reduce (:mod:`fp8train.nn.delayed.reduction`) must cover the same states in
the same order on every rank, including states whose module did not run on some rank this
step (they contribute zero amaxes). Only a collection of every live state knows those: no
owner holds them all (an autocast lasts one step and sees the modules that ran in it; the
model is never handed over), so one registry remains here (:func:`register`), ordered by
first forward. Every module must therefore run at the first step on every rank (as
Transformer Engine requires); later steps may skip modules anywhere. It holds its states
weakly: a dropped model leaves it.

Beside it, what the end of a running backward owes (:func:`~fp8train.nn.delayed.reduction.end_backward`):
whether it is hooked, whether a grad_output amax waits there for the batched reduction, and
whether a forward outside any autocast may have left its update to it. A backward whose end
owes nothing queues no callback (issue 38: a step inside ``fp8train.autocast`` owes none).
"""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = [
    "register",
    "register_eagerly",
    "REGISTERED",
    "REGISTRY",
    "registered_states",
    "reducing_states",
    "backward_end_queued",
    "grad_output_reduction_owed",
    "owe_forward_update_at_backward_end",
    "backward_end_owes",
    "take_forward_updates_owed",
]


class _Registry:
    """Every live delayed-scaling state, in the order of its first forward: ``refs``, a weak
    reference per state under its key (keys only grow, so the dictionary's own order is that
    order: no sort; a plain dictionary, which a forward looks its state up in without a
    call, issue 38); whether the running backward's
    end is hooked (:func:`backward_end_queued`), whether a state's grad_output amax waits
    there for the batched reduction, and whether a forward outside any autocast may owe its
    update there (set when one does; cleared only by the backward end that applies them)."""

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref] = {}
        self.order = itertools.count()
        self.backward_end_queued = False
        self.grad_output_reduction_owed = False
        self.forward_updates_owed = False


_REGISTRY = _Registry()

REGISTRY = _REGISTRY
"""The registry itself, whose flags a backward reads without a call (issue 38)."""
REGISTERED = _REGISTRY.refs
"""``{registry_key: weak reference}`` of every registered state: a state ``s`` is registered
where ``REGISTERED[s.registry_key]() is s`` (a deepcopy carries a stale key)."""


def backward_end_queued(queued: bool) -> bool:
    """Set whether the running backward's end is hooked; returns whether it was."""
    was, _REGISTRY.backward_end_queued = _REGISTRY.backward_end_queued, queued
    return was


def grad_output_reduction_owed(owed: bool) -> bool:
    """Set whether a grad_output amax waits for the batched reduction; returns whether one did."""
    was, _REGISTRY.grad_output_reduction_owed = _REGISTRY.grad_output_reduction_owed, owed
    return was


def owe_forward_update_at_backward_end() -> None:
    """Note that a forward outside any autocast owes its update at a backward's end."""
    _REGISTRY.forward_updates_owed = True


def take_forward_updates_owed() -> bool:
    """Whether a forward may owe its update at this backward's end (then the states say
    which: ``owed_at_backward_end``); clears the note, which that end settles."""
    was, _REGISTRY.forward_updates_owed = _REGISTRY.forward_updates_owed, False
    return was


def backward_end_owes() -> bool:
    """Whether the end of a backward has anything to do: a grad_output amax waiting for the
    batched reduction, or a forward update owed there."""
    return _REGISTRY.grad_output_reduction_owed or _REGISTRY.forward_updates_owed


def register(state: DelayedScalingState) -> None:
    """Add ``state`` to the batched amax reduction, once.

    Under ``torch.compile`` (which cannot trace the weak registry: a graph break in every
    forward) this is a no-op, and the outermost ``fp8train.autocast``'s exit registers the
    states that ran, in the order they ran: the same order, in eager code.
    """
    if not torch.compiler.is_compiling():
        register_eagerly(state)


def register_eagerly(state: DelayedScalingState) -> None:
    """:func:`register` where the caller knows ``torch.compile`` does not trace."""
    key = state.registry_key
    refs = _REGISTRY.refs
    if key is not None and key in refs and refs[key]() is state:  # (a deepcopy carries a stale key)
        return
    state.registry_key = key = next(_REGISTRY.order)
    refs[key] = weakref.ref(state, lambda _, key=key: refs.pop(key, None))  # a dropped model leaves it


def registered_states() -> list[DelayedScalingState]:
    """Registered live states, in registration order."""
    states = [ref() for ref in list(_REGISTRY.refs.values())]  # (a copy: a state may die meanwhile)
    return [s for s in states if s is not None]


def reducing_states() -> list[DelayedScalingState]:
    """Registered live states whose recipe reduces amaxes, in registration order."""
    return [s for s in registered_states() if s.recipe.reduce_amax]
