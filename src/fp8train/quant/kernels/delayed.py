"""Delayed scaling's per-step arithmetic on the CPU kernels (:mod:`.numba_delayed`,
:mod:`.numba_fp8`): an amax recorded into its history element in the read that measures it,
and a state's update in one call instead of a dozen PyTorch ops on small tensors (issue 38).
Bit for bit what :func:`fp8train.nn.delayed.amax.record_amax` and
:func:`fp8train.quant.scaling.update_scale_and_history` compute
(``tests/quant/kernels/test_delayed_kernels.py``); where the kernels do not apply the caller
takes those (the reference path, a GPU, a trace).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...spec.recipes import DelayedScaling
from ...spec.roles import Role
from .launch import BITS_LIKE, kernels_enabled
from .launch import LAUNCH_STATE, compiled_elements as numba_elements  # (kernels_enabled's own reads)
from .settings import ACTIVE_SETTINGS

__all__ = ["fold_amax", "try_update_delayed"]

_MAX_MARGIN = 126
"""The largest margin the kernel divides by (``2**margin`` a normal float32); past it the ops do."""


@functools.cache
def _compiled():
    """The compiled kernels (numba imports: :func:`.launch.kernels_usable` said so)."""
    from . import numba_delayed, numba_fp8

    return numba_fp8, numba_delayed


def fold_amax(x2d: torch.Tensor, into: torch.Tensor) -> None:
    """``into.copy_(torch.maximum(into, max|x2d|))`` in one read of ``x2d``: ``into`` a float32
    element (of a CPU history), ``x2d`` a plain, non-empty 2-D CPU tensor of a
    high-precision dtype, outside any trace, in a block that holds the kernels (a layer's:
    :data:`~.launch.KERNEL_LAUNCH` ``.depth``)."""
    source = x2d.contiguous() if x2d.dtype is not torch.float16 else x2d.detach().to(torch.float32)
    m, n = source.shape
    _compiled()[0].max_magnitude_at(source.data_ptr(), BITS_LIKE[source.dtype], m, n, into.data_ptr())


def try_update_delayed(
    amax_history: torch.Tensor, scale: torch.Tensor, recipe: DelayedScaling, roles: slice, compiling: bool | None = None
) -> bool:
    """:func:`~fp8train.quant.scaling.update_scale_and_history` of the columns ``roles`` of a
    delayed state's whole buffers (``amax_history`` ``(L, *S, R)``, ``scale`` ``(*S, R)``, ``R``
    roles) by ``recipe`` in one kernel call, in place; ``False`` where the kernels do not take
    them (then nothing is done): a trace, not the CPU kernels' path, buffers that are not
    contiguous float32, an ``amax_compute_algo`` that is a callable, a margin past 126.
    ``compiling``: whether ``torch.compile`` traces, where the caller asked (``None``: ask)."""
    # Not traced first: kernels_enabled's cached helper would make Dynamo warn.
    if scale.device.type != "cpu" or (torch.compiler.is_compiling() if compiling is None else compiling):
        return False
    # kernels_enabled's tests, read without its call where they pass (issue 38): the setting,
    # no fork after a launch, numba imported; it says the rest (and raises where it should).
    if ACTIVE_SETTINGS.settings.quantize_kernel == "reference":
        return False
    if (LAUNCH_STATE["forked_after_launch"] or numba_elements() is None) and not kernels_enabled():
        return False
    algo, margin = recipe.amax_compute_algo, recipe.margin
    if not (algo == "max" or algo == "most_recent") or margin > _MAX_MARGIN or type(scale) is not torch.Tensor:
        return False
    if scale.dtype is not torch.float32 or amax_history.dtype is not torch.float32:
        return False
    if not (scale.is_contiguous() and amax_history.is_contiguous()):
        return False
    columns = scale.shape[0] if scale.ndim == 1 else scale.numel()  # (one state's: no call)
    last = _last_maxes
    maxes = last[1] if last[0] is recipe else _remember_maxes(recipe)
    _compiled()[1].update_delayed_at(
        amax_history.data_ptr(), scale.data_ptr(), amax_history.shape[0], columns, scale.shape[-1],
        roles.start, roles.stop, maxes, np.float32(2.0**margin), algo == "most_recent",
    )
    return True


_last_maxes: tuple = (None, ())
"""The recipe last updated and its :func:`_role_maxes`, one tuple (read whole: a thread sees a
pair): looked up without hashing the recipe (issue 38)."""


def _remember_maxes(recipe: DelayedScaling) -> tuple[float, ...]:
    global _last_maxes
    _last_maxes = recipe, _role_maxes(recipe)
    return _last_maxes[1]


@functools.lru_cache(maxsize=64)
def _role_maxes(recipe: DelayedScaling) -> tuple[float, ...]:
    """Each role's format's largest finite value, in :class:`~fp8train.spec.roles.Role` order."""
    return tuple(recipe.role_format(role).max for role in Role)
