"""Who runs one Linear call's work (:class:`LinearKernels`): the bound kind, each choice made
once per plan, backend, device type and settings, and the checked kind, every call through
its checked door; the package's docstring (:mod:`fp8train.quant.operand`) says which takes a
call (:func:`takes_bound_path`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from ...spec.plan import OperandPlan
from ...spec.roles import Gemm, Role
from ..cast import HIGH_PRECISION_DTYPES
from ..gemm import backend_log, bound_scaled_mm, checked_scaled_mm
from ..kernels.launch import kernels_enabled, launch_kernels
from ..kernels.settings import ACTIVE_SETTINGS
from ..quantize import PLAIN_TENSOR_TYPES
from .role import RoleQuantizer, bound_role_quantizers, checked_role_quantizer

__all__ = ["LinearKernels", "bound_kernels", "checked_kernels", "takes_bound_path", "check_shapes"]


@dataclass(frozen=True, eq=False)
class LinearKernels:
    """Who runs one Linear call's work.

    Attributes:
        input, weight, grad_output: each role's quantizer.
        mm: the scaled GEMM, called as :func:`~fp8train.quant.gemm.bound_scaled_mm`'s.
        launch: the block a bound call's forward or backward runs in (the CPU kernels held
            for all its launches); ``None`` where there is none to hold: the bound kind
            with no CPU kernel to launch (a GPU, the reference path: no block, not an empty
            one, whose enter and exit were four calls a step, issue 38), and the checked
            kind, whose calls run in none (Dynamo traces them, and wraps no context manager
            built in a graph).
        bound: the bound kind (never traced by ``torch.compile``), or the checked one.
    """

    input: RoleQuantizer
    weight: RoleQuantizer
    grad_output: RoleQuantizer
    mm: Callable[..., torch.Tensor]
    launch: ContextManager | None = None
    bound: bool = False


@functools.lru_cache(maxsize=256)
def check_shapes(plan: OperandPlan, m: int, k: int, n: int, delayed_scale: bool) -> None:
    """The checked doors' shape rules for a call of ``x[m, k] @ W[n, k]^T`` under ``plan``,
    checked once per distinct shape (the bound kernels check no argument): every quantized
    slot's tensor (input ``[m, k]``, weight ``[n, k]``, grad_output ``[m, n]``) along its
    axis; ``delayed_scale``: per-tensor scales are given (delayed scaling).

    Raises:
        ValueError: as :func:`~fp8train.quant.quantize.quantize` for the same tensor.
    """
    shapes = {Role.INPUT: (m, k), Role.WEIGHT: (n, k), Role.GRAD_OUTPUT: (m, n)}
    for op in plan.operands:
        op.rule.check_input(shapes[op.role], op.axis, scale_given=delayed_scale and op.delayed, noun="tensor")


def takes_bound_path(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, compiling: bool) -> bool:
    """Whether a call on these tensors runs on :func:`bound_kernels`: plain tensors (not
    subclasses: a DTensor's ops must dispatch, an FP8-gathered tensor gives its own
    operands), of one high-precision dtype and device, a non-empty input, outside
    ``torch.compile`` (``compiling``: whose graph takes the checked doors)."""
    if compiling or type(input) is not torch.Tensor or type(weight) not in PLAIN_TENSOR_TYPES:
        return False
    if bias is not None and type(bias) not in PLAIN_TENSOR_TYPES:
        return False
    if input.dtype not in HIGH_PRECISION_DTYPES or weight.dtype != input.dtype or 0 in input.shape:
        return False
    return input.device == weight.device


def _operand_pairs(plan: OperandPlan):
    """The ``(a, b)`` granularities of each GEMM the plan quantizes, in GEMM order."""
    for gemm in Gemm:
        if plan.quantizes(gemm):
            a, b = gemm.usages
            yield plan.operand(a).granularity, plan.operand(b).granularity


@functools.lru_cache(maxsize=128)
def _bound_kernels(plan: OperandPlan, backend: str, device_type: str, settings) -> LinearKernels | None:
    roles = bound_role_quantizers(plan, device_type)
    if roles is None:
        return None
    mm = bound_scaled_mm(backend, device_type, _operand_pairs(plan))
    launch = launch_kernels() if device_type == "cpu" and kernels_enabled() else None
    return LinearKernels(*roles, mm=mm, launch=launch, bound=True)


backend_log.on_forget(_bound_kernels.cache_clear)  # bound kernels log their backend when built


def bound_kernels(plan: OperandPlan, backend: str, device_type: str) -> LinearKernels:
    """The bound kernels of ``plan`` and ``backend`` on ``device_type`` under the current
    quantization settings (built once per distinct four; a plan of two format families
    takes :func:`checked_kernels`)."""
    kernels = _bound_kernels(plan, backend, device_type, ACTIVE_SETTINGS.settings)
    return checked_kernels(plan, backend) if kernels is None else kernels


def checked_kernels(plan: OperandPlan, backend: str) -> LinearKernels:
    """Every quantization and GEMM through its checked door (any tensor, any trace)."""
    roles = (checked_role_quantizer(plan, role) for role in Role)
    return LinearKernels(*roles, mm=checked_scaled_mm(backend))
