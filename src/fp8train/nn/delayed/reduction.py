"""Delayed scaling across a step: the forward update at the outermost autocast's exit (or,
in a loop that uses no autocast, at the end of the backward), the grad_output update in
the backward, and the batched amax all-reduce across processes (over every registered
state, :func:`fp8train.nn.delayed.registry.reducing_states`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .amax import TORCH_IS_INITIALIZED, TORCH_WORLD, all_reduce_max, reduction_active
from .registry import (
    REGISTRY,
    backward_end_queued,
    grad_output_reduction_owed,
    reducing_states,
    register,
    registered_states,
    take_forward_updates_owed,
)
from .state import FORWARD_ROLES, GRAD_OUTPUT_ROLES, DelayedScalingState, update_delayed_tensors

__all__ = ["end_step", "end_backward", "settle_before_forward", "update_grad_output", "queue_end_backward"]


def _reduce_and_update(
    pending: Sequence[DelayedScalingState], roles: slice, group: object | None
) -> list[DelayedScalingState]:
    """Single process: rescale and roll ``roles`` of the ``pending`` states. Distributed:
    one all-reduce (MAX) of ``roles`` over every registered reducing state, then every
    tensor that ran on some rank is rescaled and rolled, identically on every rank.
    Returns the states the all-reduce covered (none in a single process)."""
    # In place on buffers that never require grad: no no_grad block (issue 38).
    reduced: list[DelayedScalingState] = []
    if reduction_active(group):
        reduced = reducing_states()
        # A state whose module did not run on a rank contributes its zero amax.
        all_reduce_max([s.amax_history[0, ..., roles] for s in reduced], group)
        for state in reduced:
            state.update(roles)
        ids = set(map(id, reduced))
        pending = [s for s in pending if id(s) not in ids]
    for state in pending:
        state.update(roles)
    return reduced


def end_step(owners: Sequence[torch.nn.Module], group: object | None, raised: bool) -> None:
    """At the outermost ``fp8train.autocast``'s exit: the forward update of the states of
    ``owners`` (the modules that trained in it, each holding ``delayed_state``), batched
    across ``group``'s processes where their recipe reduces amaxes.

    A rank whose block ``raised`` does not enter a collective its peers may never join (it
    would hang, and them with it, until the group's timeout): its amaxes stay in the
    history's current row and join the next step's reduction.
    """
    compiling = torch.compiler.is_compiling()  # asked once for the step's updates (issue 38)
    # A single process told without a call where torch's own record says so (TORCH_WORLD)
    single = not compiling and TORCH_WORLD is not None and dist.is_initialized is TORCH_IS_INITIALIZED
    reducing = not (single and TORCH_WORLD._default_pg is None) and reduction_active(group)
    states = []
    for owner in owners:
        state = owner.delayed_state
        if state.forward_traced:  # (an eager forward registered its state, and defers nothing)
            register(state)
            if state.defer_until_backward(owner, group):
                continue
        state.forward_pending = False
        if reducing:
            states.append(state)
        else:  # one process: the state's own update, now (_reduce_and_update's, inline)
            state.update(FORWARD_ROLES, compiling)
    if reducing and not raised:
        _reduce_and_update(states, FORWARD_ROLES, group)


def settle_before_forward(owner: torch.nn.Module, autocast_state: object | None) -> None:
    """Before a forward of ``owner`` outside the autocast that owes its update: apply the
    forward update its state still owes because no backward ran since its last training
    forward outside any autocast. Distributed, where the recipe reduces amaxes, it is one
    all-reduce over every registered state (every rank reaches it at the same module, the
    first of the forward), so ranks never drift apart. Not while ``torch.compile`` traces
    (its forward updates as :meth:`~fp8train.nn.delayed.state.DelayedScalingState.begin_forward` says),
    nor in activation checkpointing's recompute inside the backward, which owes nothing
    (the end of that backward applies the update, batched): the caller
    (:meth:`~fp8train.nn.modules.base.Float8Module._delayed_tensors`) calls this only for
    an eager forward that is not a recompute.
    """
    state = owner.delayed_state
    if not state.forward_pending or (autocast_state is not None and owner in autocast_state.pending):
        return
    if state.recipe.reduce_amax and reduction_active(None):
        for reduced in _reduce_and_update([], FORWARD_ROLES, None):
            reduced.settle()
    else:
        state.finish_forward_update()


def end_backward(group: object | None) -> None:
    """When the autograd engine finishes a backward that used a delayed grad_output scale:
    the batched grad_output update (distributed), and the forward update of every state
    whose forward ran outside any autocast, batched into the same all-reduce where its
    recipe reduces amaxes. A loop that never enters ``fp8train.autocast`` (transformers'
    ``Trainer``, accelerate) thus keeps every rank's scales and histories identical, and
    leaves nothing owed that the ``state_dict`` lacks."""
    backward_end_queued(False)
    reduce_grad_output = grad_output_reduction_owed(False)
    owed = [s for s in registered_states() if s.owed_at_backward_end] if take_forward_updates_owed() else []
    if reduction_active(group):
        reduce_forward = any(s.recipe.reduce_amax for s in owed)
        if reduce_forward or reduce_grad_output:
            first = FORWARD_ROLES.start if reduce_forward else GRAD_OUTPUT_ROLES.start
            last = GRAD_OUTPUT_ROLES.stop if reduce_grad_output else FORWARD_ROLES.stop
            for state in _reduce_and_update([], slice(first, last), group):
                if reduce_forward:
                    state.settle()
        owed = [s for s in owed if not s.recipe.reduce_amax]
    for state in owed:
        state.finish_forward_update()


def update_grad_output(
    amax_history: torch.Tensor, scale: torch.Tensor, recipe: object, group: object | None
) -> None:
    """After a backward used grad_output's scale (once per step): single process, rescale
    and roll its column of this state (or this element of a batch of states) now.

    Distributed, a state's grad_output amax cannot be applied in its own backward (that
    would be one collective per module, and a module skipped on one rank would hang the
    others); it waits for :func:`end_backward`, queued once per backward, which also
    applies the forward updates owed by forwards outside any autocast. A compiled
    backward of a single process queues nothing (its forwards update as
    :meth:`~fp8train.nn.delayed.state.DelayedScalingState.defer_until_backward` says).
    """
    compiling = torch.compiler.is_compiling()
    # (a single process told without a call, as end_step tells it)
    single = not compiling and TORCH_WORLD is not None and dist.is_initialized is TORCH_IS_INITIALIZED
    if recipe.reduce_amax and not (single and TORCH_WORLD._default_pg is None) and reduction_active(group):
        grad_output_reduction_owed(True)
    else:
        update_delayed_tensors(amax_history, scale, recipe, GRAD_OUTPUT_ROLES, compiling)
        if compiling:
            return
    if REGISTRY.grad_output_reduction_owed or REGISTRY.forward_updates_owed:  # (queue_end_backward's test, inline)
        queue_end_backward(group)


def queue_end_backward(group: object | None) -> None:
    """Have the running backward end with :func:`end_backward` (once per backward) where it
    owes something there (:func:`~fp8train.nn.delayed.registry.backward_end_owes`): also
    where a backward uses no delayed grad_output scale (a mixture whose backward is not
    delayed), so that forward updates owed there are applied."""
    # (backward_end_owes, inline: a call less each backward, issue 38)
    if (REGISTRY.grad_output_reduction_owed or REGISTRY.forward_updates_owed) and not backward_end_queued(True):
        torch.autograd.Variable._execution_engine.queue_callback(lambda: end_backward(group))
