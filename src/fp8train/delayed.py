"""Delayed-scaling state of converted modules: recording amaxes and the batched update.

Each module using :class:`~fp8train.recipes.DelayedScaling` owns two buffers, one column
per quantized tensor (``input``, ``weight``, ``grad_output``):

* ``fp8_scale``: float32 ``(3,)``, initialised to 1;
* ``fp8_amax_history``: float32 ``(amax_history_len, 3)``, initialised to 0; row 0 holds
  the amax recorded in the current step.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Iterable

import torch
import torch.distributed as dist

from .formats import format_of
from .recipes import DelayedScaling
from .scaling import delayed_scaling_update

__all__ = [
    "ROLES",
    "INPUT",
    "WEIGHT",
    "GRAD_OUTPUT",
    "fp8_max_per_role",
    "record_amax",
    "reduce_current_amaxes",
    "reduction_active",
    "update_delayed_tensors",
    "register",
    "reducing_modules",
    "step_end_update",
    "grad_output_flush",
]

ROLES = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD_OUTPUT = range(3)
FORWARD_ROLES = slice(INPUT, GRAD_OUTPUT)
GRAD_OUTPUT_ROLES = slice(GRAD_OUTPUT, GRAD_OUTPUT + 1)
ALL_ROLES = slice(INPUT, GRAD_OUTPUT + 1)


def fp8_max_per_role(recipe: DelayedScaling, device: torch.device | None = None) -> torch.Tensor:
    """Largest finite value of each role's format, float32 ``(3,)``."""
    dtypes = (recipe.input_dtype, recipe.weight_dtype, recipe.grad_output_dtype)
    return torch.tensor([format_of(d).max for d in dtypes], dtype=torch.float32, device=device)


def record_amax(amax_history: torch.Tensor, role: int, tensor: torch.Tensor) -> None:
    """Fold ``max|tensor|`` into ``amax_history[0, role]`` (max over calls in one step)."""
    if tensor.numel() == 0:
        return
    amax = tensor.detach().abs().amax().to(torch.float32)
    current = amax_history[0, role]
    # torch.maximum propagates NaN, which the update then treats as "keep the scale".
    current.copy_(torch.maximum(current, amax))


def reduce_current_amaxes(current_amaxes: list[torch.Tensor], group: object | None) -> None:
    """All-reduce (MAX) the current amaxes of every tensor in one collective, in place.

    A no-op without an initialized process group of size > 1. Every rank must call it with
    the same list of tensors (same modules, same order): a module that did not run on a
    rank contributes its zero amax.
    """
    if not reduction_active(group) or not current_amaxes:
        return
    flat = torch.cat([a.reshape(-1) for a in current_amaxes])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for a in current_amaxes:
        a.copy_(flat[offset : offset + a.numel()].view_as(a))
        offset += a.numel()


def reduction_active(group: object | None = None) -> bool:
    """Whether amaxes are reduced: a ``torch.distributed`` group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def update_delayed_tensors(modules: Iterable[torch.nn.Module], roles: slice) -> None:
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
            module.fp8_amax_history[:, roles],
            module.fp8_scale[roles],
            fp8_max,
            margin=recipe.margin,
            algo=recipe.amax_compute_algo,
        )


# Every module with delayed-scaling state, in the order of their first forward. The batched all-reduce covers
# all of them on every rank, in this order, so the collective matches across ranks even
# when some modules did not run on some rank (they contribute zero amaxes).
_REGISTRY: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_REGISTRATION_ORDER = itertools.count()


def register(module: torch.nn.Module) -> None:
    """Add ``module`` (owning delayed-scaling state) to the batched amax reduction, once.

    Modules register at their first forward, so the first step must run every module on
    every rank (as Transformer Engine requires); later steps may skip modules anywhere.
    """
    key = getattr(module, "_fp8_registry_key", None)
    if key is not None and _REGISTRY.get(key) is module:  # (a deepcopy carries a stale key)
        return
    module._fp8_registry_key = next(_REGISTRATION_ORDER)
    _REGISTRY[module._fp8_registry_key] = module


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
            reduce_current_amaxes([m.fp8_amax_history[0, roles] for m in modules], group)
            update_delayed_tensors(modules, roles)
            reduced = set(map(id, modules))
            pending = [m for m in pending if id(m) not in reduced]
        update_delayed_tensors(pending, roles)


def step_end_update(pending: list[torch.nn.Module], group: object | None) -> None:
    """The forward-tensor update at the exit of the outermost ``fp8train.autocast``."""
    _reduce_and_update(pending, FORWARD_ROLES, group)


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
