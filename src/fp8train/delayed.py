"""Delayed-scaling state of converted modules: recording amaxes and the batched update.

Each module using :class:`~fp8train.recipes.DelayedScaling` owns two buffers, one column
per quantized tensor (``input``, ``weight``, ``grad_output``):

* ``fp8_scale``: float32 ``(3,)``, initialised to 1;
* ``fp8_amax_history``: float32 ``(amax_history_len, 3)``, initialised to 0; row 0 holds
  the amax recorded in the current step.
"""

from __future__ import annotations

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
    "update_delayed_tensors",
]

ROLES = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD_OUTPUT = range(3)
FORWARD_ROLES = slice(INPUT, GRAD_OUTPUT)


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
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return
    if not current_amaxes:
        return
    flat = torch.cat([a.reshape(-1) for a in current_amaxes])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for a in current_amaxes:
        a.copy_(flat[offset : offset + a.numel()].view_as(a))
        offset += a.numel()


def update_delayed_tensors(modules: Iterable[torch.nn.Module], roles: slice, group: object | None = None) -> None:
    """Reduce, rescale and roll the delayed-scaling state of ``roles`` of every module.

    Args:
        modules: modules owning ``fp8_scale``, ``fp8_amax_history`` and ``delayed_recipe``.
        roles: the columns to update (forward roles, or grad_output).
        group: process group for the amax all-reduce (``None``: the default group).
    """
    modules = list(modules)
    reducing = [m for m in modules if m.delayed_recipe.reduce_amax]
    reduce_current_amaxes([m.fp8_amax_history[0, roles] for m in reducing], group)
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
