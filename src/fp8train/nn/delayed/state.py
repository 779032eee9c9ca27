"""Delayed scaling's state: :class:`DelayedScalingState`, one per converted module.

A module using :class:`~fp8train.spec.recipes.DelayedScaling` registers two buffers (its
``state_dict`` keys), one column per quantized tensor (:attr:`Role.index
<fp8train.spec.roles.Role.index>`: input, weight, grad_output):

* ``fp8_scale``: float32 ``(3,)``, initialised to 1;
* ``fp8_amax_history``: float32 ``(amax_history_len, 3)``, initialised to 0; row 0 holds
  the amax recorded in the current step.

A module holding many such states at once (the experts of an MoE layer,
:mod:`fp8train.nn.modules.experts`) adds leading dims ``S``: ``fp8_scale`` ``(*S, 3)`` and
``fp8_amax_history`` ``(amax_history_len, *S, 3)``; each element is updated on its own.

The :class:`DelayedScalingState` the module holds reads those buffers from the module's
buffer table (so ``module.to(...)``, ``load_state_dict(assign=True)``, ``deepcopy`` and
FSDP/TP keep it pointing at the module's tensors) and owns the step's bookkeeping: whether
a forward update is owed, whether it waits for the backward (``torch.compile``), and the
scales this step's forwards used (an activation-checkpointing recompute quantizes with
them). The step's updates, batched across processes, are :mod:`fp8train.nn.delayed.reduction`'s;
the registry of every live state, which their all-reduce follows, is
:mod:`fp8train.nn.delayed.registry`'s.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Mapping, NamedTuple

import torch
import torch.utils.checkpoint

from ...quant.constants import device_constant
from ...quant.kernels.delayed import try_update_delayed
from ...quant.kernels.settings import ACTIVE_SETTINGS
from ...quant.scaling import update_scale_and_history
from ...spec.recipes import DelayedScaling
from ...spec.roles import Role
from .amax import reduction_active
from .registry import REGISTERED, owe_forward_update_at_backward_end, register_eagerly

__all__ = [
    "DelayedScalingState",
    "DelayedTensors",
    "NUM_ROLES",
    "FORWARD_ROLES",
    "GRAD_OUTPUT_ROLES",
    "SCALE_BUFFER",
    "AMAX_HISTORY_BUFFER",
    "fp8_max_per_role",
    "update_delayed_tensors",
    "update_by_ops",
    "is_recompute",
]

NUM_ROLES = len(Role)
FORWARD_ROLES = slice(Role.INPUT.index, Role.GRAD_OUTPUT.index)
"""Columns of the forward roles (input, weight), updated at the outermost autocast's exit."""
GRAD_OUTPUT_ROLES = slice(Role.GRAD_OUTPUT.index, Role.GRAD_OUTPUT.index + 1)
"""Column of grad_output, updated when its backward has used it."""
SCALE_BUFFER, AMAX_HISTORY_BUFFER = "fp8_scale", "fp8_amax_history"
"""The module buffers (``state_dict`` keys) holding the state."""


def fp8_max_per_role(recipe: DelayedScaling, device: torch.device | None = None) -> torch.Tensor:
    """Largest finite value of each role's format, float32 ``(NUM_ROLES,)``: built once per
    device and shared (read it only), so an update copies nothing from the host."""
    # Traced, the cache's wrapper would make Dynamo warn; the tuple is built at trace time anyway.
    role_maxes = _role_maxes.__wrapped__ if torch.compiler.is_compiling() else _role_maxes
    return device_constant(role_maxes(recipe), torch.float32, device)


@functools.lru_cache(maxsize=64)
def _role_maxes(recipe: DelayedScaling) -> tuple[float, ...]:
    """Each role's format's largest finite value, per recipe (asked twice a step: cached)."""
    return tuple(recipe.role_format(role).max for role in Role)


def update_delayed_tensors(
    amax_history: torch.Tensor, scale: torch.Tensor, recipe: DelayedScaling, roles: slice, compiling: bool | None = None
) -> None:
    """Rescale and roll the columns ``roles`` of one state's tensors, in place (local: the
    current amaxes are already reduced where they should be).

    Args:
        amax_history: ``(amax_history_len, *S, NUM_ROLES)``, or a view of one element of it.
        scale: ``(*S, NUM_ROLES)``, likewise.
        recipe: the recipe the state follows.
        roles: the columns to update (forward roles, grad_output, or all).
        compiling: whether ``torch.compile`` traces, where the caller asked (``None``: ask).
    """
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    # On CPU, one kernel call (issue 38); not asked where it says no without looking: a trace,
    # the reference path (a call less there).
    kernel = not compiling and ACTIVE_SETTINGS.settings.quantize_kernel != "reference"
    if not (kernel and try_update_delayed(amax_history, scale, recipe, roles, False)):
        update_by_ops(amax_history, scale, recipe, roles, compiling)


def update_by_ops(amax_history: torch.Tensor, scale: torch.Tensor, recipe: DelayedScaling, roles: slice, compiling: bool) -> None:
    """:func:`update_delayed_tensors` by PyTorch's ops (where the CPU kernel does not take it)."""
    if compiling:
        fp8_max = fp8_max_per_role(recipe, scale.device)
    else:  # the maxes of the recipe last seen on this device, without a call (eight, issue 38)
        device = scale.device
        try:
            seen, fp8_max = _FP8_MAXES[device]
        except KeyError:
            seen = None
        if seen is not recipe:
            _FP8_MAXES[device] = recipe, (fp8_max := fp8_max_per_role(recipe, device))
    # The module's own buffers, shaped by the recipe: valid by construction (the public,
    # checked delayed_scaling_update costs ten calls more an update).
    update_scale_and_history(
        amax_history[..., roles], scale[..., roles], fp8_max[roles], recipe.margin, recipe.amax_compute_algo, not compiling
    )


_FP8_MAXES: dict = {}
"""``{device: (recipe, fp8_max_per_role(recipe, device))}``: the recipe last updated on each
device, and its maxes (outside a trace)."""


class DelayedTensors(NamedTuple):
    """What one forward of the owning module hands its GEMMs
    (:class:`~fp8train.nn.function.Float8LinearFunction`).

    Attributes:
        scale: the ``fp8_scale`` buffer (the backward reads and updates grad_output's column).
        amax_history: the ``fp8_amax_history`` buffer, or ``None`` for a forward that only
            reads the state (evaluation).
        forward_scale: the scales an activation-checkpointing recompute quantizes the input
            and weight with (those of the forward it repeats; it records no amax), or
            ``None`` for a first run, which quantizes with ``scale`` and records its amaxes.
    """

    scale: torch.Tensor
    amax_history: torch.Tensor | None
    forward_scale: torch.Tensor | None


def _checkpoint_forward_code():
    function = getattr(torch.utils.checkpoint, "CheckpointFunction", None)
    return getattr(getattr(function, "forward", None), "__code__", None)


_REENTRANT_CHECKPOINT_FORWARD = _checkpoint_forward_code()


def _in_reentrant_checkpoint_forward() -> bool:
    """Whether ``torch.utils.checkpoint(..., use_reentrant=True)`` runs its first forward
    (under ``torch.no_grad``) in this thread: its frame is among the callers'. PyTorch
    marks that forward no other way; it is a training forward whose backward recomputes it."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_CHECKPOINT_FORWARD:
            return True
        frame = frame.f_back
    return False


def is_recompute() -> bool:
    """Whether this forward runs inside a backward (activation checkpointing's recompute,
    reentrant or not): the autograd engine is executing a graph task in this thread."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


class DelayedScalingState:
    """The delayed-scaling state of one module: its buffers and a step's bookkeeping.

    A step, as the owning module and ``fp8train.autocast`` drive it:

    1. :meth:`begin_forward`, at each forward: apply a forward update still owed by a
       forward outside any autocast, then, for a training forward, owe this one's (inside an
       autocast, on its ``pending`` list). The GEMMs record the input's and weight's amaxes.
    2. :meth:`finish_forward_update`, at the outermost autocast's exit: rescale and roll
       the forward columns (:func:`fp8train.nn.delayed.reduction.end_step` batches it across
       processes), unless :meth:`defer_until_backward` makes it wait for the backward.
       Outside any autocast (a loop fp8train does not own), at the end of the backward
       (:func:`fp8train.nn.delayed.reduction.end_backward`, batched likewise), or at the next
       forward where none ran; so after a step nothing is owed that the ``state_dict``
       lacks.
    3. The backward records grad_output's amax and updates its column
       (:func:`fp8train.nn.delayed.reduction.update_grad_output`).

    Activation checkpointing: the backward's recompute of a forward neither records an amax
    nor owes an update, and quantizes with the scales the repeated forward used (kept here
    when an update replaced them, at the autocast's exit, before the backward).

    Args:
        buffers: the owning module's buffer table, holding :data:`SCALE_BUFFER` and
            :data:`AMAX_HISTORY_BUFFER` (see :meth:`initial_buffers`).
        recipe: the recipe the state follows.

    Attributes:
        recipe: the recipe the state follows (an autocast override with the same history
            length replaces it, see :meth:`follow`).
        registry_key: its place in the batched amax reduction (``None`` until registered).
        forward_pending: a training forward recorded amaxes whose forward update is owed.
        owed_at_backward_end: that forward ran outside any autocast (eagerly): the end of
            its backward applies the update.
        update_after_backward: that update waits for the backward (:meth:`defer_until_backward`).
        forward_traced: the last forward ran while ``torch.compile`` traced it.
    """

    def __init__(self, buffers: Mapping[str, torch.Tensor], recipe: DelayedScaling) -> None:
        self._buffers = buffers
        self.recipe = recipe
        self.registry_key: int | None = None
        self.forward_pending = False
        self.owed_at_backward_end = False
        self.update_after_backward = False
        self.forward_traced = False
        self._hooked_parameter_id: int | None = None  # an int: the owner still pickles
        # The scales this step's forwards used, where an update replaced them since.
        self._forward_scale: torch.Tensor | None = None
        self._training_tensors: DelayedTensors | None = None  # what a training forward returns

    _training_tensors = None  # (a state unpickled from an older release has none of its own)

    @staticmethod
    def initial_buffers(
        recipe: DelayedScaling, leading_shape: tuple[int, ...] = (), device=None
    ) -> dict[str, torch.Tensor]:
        """The buffers a new state starts from, ``{name: tensor}``: scales 1, history 0."""
        shape = (*leading_shape, NUM_ROLES)
        return {
            SCALE_BUFFER: torch.ones(shape, dtype=torch.float32, device=device),
            AMAX_HISTORY_BUFFER: torch.zeros(recipe.amax_history_len, *shape, dtype=torch.float32, device=device),
        }

    @property
    def scale(self) -> torch.Tensor:
        """float32 ``(*S, NUM_ROLES)``: the owner's ``fp8_scale`` buffer."""
        return self._buffers[SCALE_BUFFER]

    @property
    def amax_history(self) -> torch.Tensor:
        """float32 ``(amax_history_len, *S, NUM_ROLES)``: the owner's ``fp8_amax_history``."""
        return self._buffers[AMAX_HISTORY_BUFFER]

    def follow(self, recipe: DelayedScaling) -> None:
        """Follow ``recipe`` (an ``fp8train.autocast`` override) from now on.

        Raises:
            ValueError: its ``amax_history_len`` differs from this state's.
        """
        if recipe == self.recipe:
            return
        if recipe.amax_history_len != self.recipe.amax_history_len:
            raise ValueError(
                f"autocast recipe has amax_history_len={recipe.amax_history_len} but this module's "
                f"state has {self.recipe.amax_history_len}; convert with the same recipe"
            )
        self.recipe = recipe

    def begin_forward(
        self, owner: torch.nn.Module, autocast_state: object | None, compiling: bool, recompute: bool, grad: bool
    ) -> DelayedTensors:
        """At a forward of ``owner``: bring the state up to date, owe this forward's update
        where it trains, and say what its GEMMs use.

        A training forward is one with grad, or reentrant checkpointing's first forward
        (without grad; its backward recomputes it); any other forward without grad only
        reads the state. A forward inside a backward is a recompute.

        Args:
            owner: the module holding this state (an autocast's ``pending`` lists it).
            autocast_state: the innermost ``fp8train.autocast``'s state (anything with
                ``pending``, a list), or ``None`` outside any autocast.
            compiling: ``torch.compile`` traces this forward.
            recompute: this forward is a recompute (:func:`is_recompute`, not traced).
            grad: ``torch.is_grad_enabled()``, as the caller asked it.
        """
        buffers = self._buffers  # (the properties' reads, inline: a call less each, issue 38)
        scale, history = buffers[SCALE_BUFFER], buffers[AMAX_HISTORY_BUFFER]
        if recompute:
            forward_scale = self._forward_scale if self._forward_scale is not None else scale
            return DelayedTensors(scale, history, forward_scale)
        trains = grad or (not compiling and _in_reentrant_checkpoint_forward())
        key = self.registry_key  # registered: at its first forward, the order every rank's amax all-reduce follows
        if not compiling and (key is None or key not in REGISTERED or REGISTERED[key]() is not self):
            register_eagerly(self)
        self.forward_traced = compiling  # see defer_until_backward
        if self.forward_pending and (autocast_state is None or owner not in autocast_state.pending):
            self.finish_forward_update()  # (in place on buffers that never require grad: no no_grad block)
        if not trains:
            return DelayedTensors(scale, None, None)
        self._forward_scale = None  # this forward uses the current scales
        if not self.forward_pending:
            self.forward_pending = True
            if autocast_state is not None:
                pending = autocast_state.pending
                pending += (owner,)  # (append's, by the operator: no call, issue 38)
            elif not compiling:
                self.owed_at_backward_end = True
                owe_forward_update_at_backward_end()
        if compiling:  # (a trace builds its own, as before)
            return DelayedTensors(scale, history, None)
        tensors = self._training_tensors  # the same tuple while the buffers are (no call to build one)
        if tensors is None or tensors[0] is not scale or tensors[1] is not history:
            self._training_tensors = tensors = DelayedTensors(scale, history, None)
        return tensors

    def update(self, roles: slice, compiling: bool | None = None) -> None:
        """Rescale and roll the columns ``roles`` (local; see :func:`update_delayed_tensors`).
        An update of the forward columns keeps the scales it replaces, with which a
        recompute of this step's forwards quantizes (not while compiling: a compiled
        forward is never recomputed through this state). ``compiling``: whether
        ``torch.compile`` traces, where the caller asked (``None``: ask)."""
        if compiling is None:
            compiling = torch.compiler.is_compiling()
        scale = self._buffers[SCALE_BUFFER]
        if roles == FORWARD_ROLES and not compiling:
            # (a buffer needs no detach unless something made it require grad: a call less)
            self._forward_scale = scale.detach().clone() if scale.requires_grad else scale.clone()
        update_delayed_tensors(self._buffers[AMAX_HISTORY_BUFFER], scale, self.recipe, roles, compiling)

    def finish_forward_update(self) -> None:
        """Apply the owed forward update (rescale and roll the input's and weight's columns)."""
        self.update(FORWARD_ROLES)
        self.settle()

    def settle(self) -> None:
        """Mark the owed forward update as applied (by :meth:`finish_forward_update` or a
        batched update of every state)."""
        self.forward_pending = self.owed_at_backward_end = self.update_after_backward = False

    def next_forward_scale(self, update_owed: bool) -> torch.Tensor:
        """A copy of the scales the next FP8 forward uses: the current ones, or, where
        ``update_owed`` and a forward update is pending, those after it (computed on copies)."""
        scale = self.scale.detach().clone()
        if update_owed and self.forward_pending:
            history = self.amax_history.detach().clone()
            update_delayed_tensors(history, scale, self.recipe, FORWARD_ROLES)
        return scale

    def defer_until_backward(self, owner: torch.nn.Module, group: object | None) -> bool:
        """At the outermost ``fp8train.autocast``'s exit: whether this state's forward update
        waits until ``owner``'s backward has run (``True``; arranged here) rather than
        happening now.

        It waits where ``torch.compile`` traced the forward (and so its backward): the
        compiled backward holds the buffers as saved tensors, records grad_output's amax and
        updates its column, and writes the buffers back whole, from what it saved. An update
        in place between the two (at this exit) would trip autograd's check on saved
        tensors, and be overwritten. The update happens instead right after the backward (a
        hook on a parameter of ``owner`` that gets a gradient) or, without one, at the next
        forward, as outside any autocast: the same numbers, since nothing reads the input's
        and weight's scales in between. Not where the recipe reduces amaxes across
        processes: that backward queues a collective, which ``torch.compile`` runs eagerly
        (with its Function), and the exit's update is the batched one.
        """
        if not self.forward_traced:
            return False
        if self.recipe.reduce_amax and reduction_active(group):
            return False
        self.update_after_backward = True
        self._hook_after_backward(owner)
        return True

    def _hook_after_backward(self, owner: torch.nn.Module) -> None:
        """Make ``owner``'s backward apply the deferred forward update: a hook on a parameter
        that gets a gradient (once; a copy of the owner, whose parameters are new, hooks its
        own)."""
        param = next((p for p in owner.parameters() if p.requires_grad), None)
        if param is None or self._hooked_parameter_id == id(param):
            return
        state_ref = weakref.ref(self)

        def update_after_backward(_: torch.Tensor) -> None:
            # Not where compiled autograd traces the hook into the backward's graph, whose
            # write-back of the saved buffers follows it: there the next forward updates.
            if torch.compiler.is_compiling():
                return
            state = state_ref()
            if state is not None and state.update_after_backward:
                with torch.no_grad():
                    state.finish_forward_update()

        param.register_post_accumulate_grad_hook(update_after_backward)
        self._hooked_parameter_id = id(param)
