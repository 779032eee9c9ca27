"""Delayed scaling across a step: the forward update at the outermost autocast's exit, the
grad_output update in the backward, and the batched amax all-reduce across processes
(over every registered state, :func:`fp8train.nn.delayed.reducing_states`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .amax import all_reduce_max, reduction_active
from .delayed import (
    FORWARD_ROLES,
    GRAD_OUTPUT_ROLES,
    DelayedScalingState,
    grad_output_flush_queued,
    reducing_states,
    register,
    update_delayed_tensors,
)

__all__ = ["end_step", "update_grad_output"]


def _reduce_and_update(pending: Sequence[DelayedScalingState], roles: slice, group: object | None) -> None:
    """Single process: rescale and roll ``roles`` of the ``pending`` states. Distributed:
    one all-reduce (MAX) of ``roles`` over every registered reducing state, then every
    tensor that ran on some rank is rescaled and rolled, identically on every rank."""
    with torch.no_grad():
        if reduction_active(group):
            states = reducing_states()
            # A state whose module did not run on a rank contributes its zero amax.
            all_reduce_max([s.amax_history[0, ..., roles] for s in states], group)
            for state in states:
                state.update(roles)
            reduced = set(map(id, states))
            pending = [s for s in pending if id(s) not in reduced]
        for state in pending:
            state.update(roles)


def end_step(owners: Sequence[torch.nn.Module], group: object | None, raised: bool) -> None:
    """At the outermost ``fp8train.autocast``'s exit: the forward update of the states of
    ``owners`` (the modules that trained in it, each holding ``delayed_state``), batched
    across ``group``'s processes where their recipe reduces amaxes.

    A rank whose block ``raised`` does not enter a collective its peers may never join (it
    would hang, and them with it, until the group's timeout): its amaxes stay in the
    history's current row and join the next step's reduction.
    """
    states = []
    for owner in owners:
        state = owner.delayed_state
        register(state)  # a no-op but for states whose forward torch.compile traced
        if not state.defer_until_backward(owner, group):
            state.forward_pending = False
            states.append(state)
    if not (raised and reduction_active(group)):
        _reduce_and_update(states, FORWARD_ROLES, group)


def update_grad_output(
    amax_history: torch.Tensor, scale: torch.Tensor, recipe: object, group: object | None
) -> None:
    """After a backward used grad_output's scale (once per step): single process, rescale
    and roll its column of this state (or this element of a batch of states) now.

    Distributed, a state's grad_output amax cannot be applied in its own backward (that
    would be one collective per module, and a module skipped on one rank would hang the
    others); it is queued to run once, batched, when the autograd engine finishes.
    """
    if not (recipe.reduce_amax and reduction_active(group)):
        update_delayed_tensors(amax_history, scale, recipe, GRAD_OUTPUT_ROLES)
        return
    if grad_output_flush_queued(True):
        return

    def flush() -> None:
        grad_output_flush_queued(False)
        _reduce_and_update([], GRAD_OUTPUT_ROLES, group)

    torch.autograd.Variable._execution_engine.queue_callback(flush)
