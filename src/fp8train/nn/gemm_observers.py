"""Observers of the FP8 modules' GEMMs: callbacks that see every eager
:meth:`~fp8train.nn.modules.linear.Float8Module.run_linear` call, FP8 on or off.

How the statistics capture (:mod:`fp8train.diagnostics.gemm_capture`) sees the GEMMs of every
``Float8Module``, those no forward hook shows (an attention's in-projection) too.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

__all__ = ["observe_gemms", "gemms_observed", "notify_gemm_observers", "GEMM_OBSERVERS"]

# The open blocks' callbacks ``(module, input, weight, output)``.
_gemm_observers: list[Callable] = []
GEMM_OBSERVERS = _gemm_observers
"""The open callbacks (the list itself, changed in place): a caller with none to notify
skips :func:`notify_gemm_observers` without a call (issue 38)."""


@contextlib.contextmanager
def observe_gemms(callback: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], None]):
    """Within the block, call ``callback(module, input, weight, output)`` after each eager
    :meth:`~fp8train.nn.modules.linear.Float8Module.run_linear` (FP8 on or off): ``input``
    ``[..., in]`` and ``weight`` ``[out, in]`` as the module passed them (before any
    autocast cast), ``output`` the result (register a hook on it for the backward's
    gradient). Not while ``torch.compile`` traces: a compiled graph runs no Python
    callbacks (run such a step eagerly)."""
    _gemm_observers.append(callback)
    try:
        yield
    finally:
        _gemm_observers.remove(callback)


def gemms_observed() -> bool:
    """Whether an :func:`observe_gemms` block is open (in eager code)."""
    return bool(_gemm_observers) and not torch.compiler.is_compiling()


def notify_gemm_observers(module: nn.Module, input, weight, output) -> torch.Tensor:
    """Call every open :func:`observe_gemms` callback on one GEMM (eagerly); ``output``."""
    if _gemm_observers and not torch.compiler.is_compiling():
        for callback in tuple(_gemm_observers):
            callback(module, input, weight, output)
    return output
