"""Amaxes: recording them, and reducing them (MAX, NaN kept) across processes in one collective.

Shared by delayed scaling (:mod:`fp8train.nn.delayed.state`) and by every distributed feature
that needs one scale for a tensor split across ranks (the ``parallel`` layer).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...quant.kernels import try_tensor_amax
from ...quant.kernels.delayed import fold_amax
from ...quant.kernels.launch import KERNEL_LAUNCH
from ...quant.prequantized import PrequantizedTensor
from ...spec.roles import Role
from ..collective_device import collective_device

__all__ = [
    "tensor_amax", "record_amax", "record_plain_amax", "record_forward_amaxes", "record_grad_output_amax",
    "record_observed_amax", "reduction_active", "TORCH_WORLD", "TORCH_IS_INITIALIZED", "all_reduce_max",
]


def tensor_amax(tensor: torch.Tensor) -> torch.Tensor:
    """``max|tensor|`` as a float32 scalar (0 for an empty tensor; NaN propagates)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    amax = try_tensor_amax(tensor)  # on CPU, one fused read
    if amax is not None:
        return amax
    # One pass, no |tensor| temporary (on a GPU one launch, not abs then amax).
    return torch.linalg.vector_norm(tensor.detach(), math.inf).to(torch.float32)


def record_amax(amax_history: torch.Tensor, column: int, tensor: torch.Tensor) -> None:
    """Fold ``max|tensor|`` into ``amax_history[0, column]`` (max over calls in one step)."""
    if tensor.numel() == 0:
        return
    current = amax_history[0, column]
    # torch.maximum propagates NaN, which the update then treats as "keep the scale".
    current.copy_(torch.maximum(current, tensor_amax(tensor)))


_DISTRIBUTED_BUILT = dist.is_available()  # how PyTorch was built: fixed for the process


def record_plain_amax(amax_history: torch.Tensor, column: int, tensor: torch.Tensor) -> None:
    """:func:`record_amax` of a plain 2-D tensor of a high-precision dtype, outside any trace
    (a layer's bound call checked it): in the kernels' read where the caller holds the CPU
    kernels (:data:`~fp8train.quant.kernels.launch.KERNEL_LAUNCH`), else one norm and one
    maximum written in place, no host sync. The same bits, in a few calls (issue 38)."""
    current = amax_history[0, column]
    if 0 in tensor.shape or current.dtype is not torch.float32:
        record_amax(amax_history, column, tensor)
    elif KERNEL_LAUNCH.depth:
        fold_amax(tensor, current)
    else:  # (detached only where in a graph, converted only where not float32: no call otherwise)
        amax = torch.linalg.vector_norm(tensor.detach() if tensor.requires_grad else tensor, math.inf)
        torch.maximum(current, amax if amax.dtype is torch.float32 else amax.to(torch.float32), out=current)


def record_forward_amaxes(amax_history: torch.Tensor, input_hp, weight_hp, kernels) -> tuple:
    """Record a layer's input and weight amaxes (:func:`record_observed_amax`), or say where
    the quantizers of ``kernels`` (a :class:`~fp8train.quant.operand.LinearKernels`) fold them
    in the reads that cast (the CPU kernels: :attr:`~fp8train.quant.operand.RoleQuantizer.folds_amax`,
    no read of their own, issue 38). Called in a Function's forward, where grad mode is off.

    Returns:
        ``(input's, weight's)`` history elements for the quantizers, or ``(None, None)``: recorded.
    """
    if kernels.input.folds_amax and kernels.weight.folds_amax and amax_history.dtype is torch.float32:
        return amax_history[0, _INPUT_COLUMN], amax_history[0, _WEIGHT_COLUMN]
    if not kernels.bound:
        record_observed_amax(amax_history, Role.INPUT, input_hp)
        record_observed_amax(amax_history, Role.WEIGHT, weight_hp)
    elif KERNEL_LAUNCH.depth or 0 in weight_hp.shape or amax_history.dtype is not torch.float32:
        record_plain_amax(amax_history, _INPUT_COLUMN, input_hp)  # (a bound call's plain tensors)
        record_plain_amax(amax_history, _WEIGHT_COLUMN, weight_hp)
    else:  # record_plain_amax's ops, inline, on tensors read as they are (two calls each, not five)
        for column, tensor in ((_INPUT_COLUMN, input_hp), (_WEIGHT_COLUMN, weight_hp)):
            current, amax = amax_history[0, column], torch.linalg.vector_norm(tensor, math.inf)
            torch.maximum(current, amax if amax.dtype is torch.float32 else amax.to(torch.float32), out=current)
    return None, None


def record_grad_output_amax(amax_history: torch.Tensor, grad_output, kernels) -> torch.Tensor | None:
    """Record grad_output's amax (:func:`record_observed_amax`), or return the history element
    the grad_output quantizer of ``kernels`` folds it into (as :func:`record_forward_amaxes`)."""
    if type(grad_output) is torch.Tensor and kernels.bound and amax_history.dtype is torch.float32:
        if kernels.grad_output.folds_amax:
            return amax_history[0, _GRAD_OUTPUT_COLUMN]
        if not (KERNEL_LAUNCH.depth or 0 in grad_output.shape):  # record_plain_amax's ops, inline
            current, amax = amax_history[0, _GRAD_OUTPUT_COLUMN], torch.linalg.vector_norm(
                grad_output.detach() if grad_output.requires_grad else grad_output, math.inf
            )
            torch.maximum(current, amax if amax.dtype is torch.float32 else amax.to(torch.float32), out=current)
            return None
    record_observed_amax(amax_history, Role.GRAD_OUTPUT, grad_output, kernels.bound)
    return None


_INPUT_COLUMN, _WEIGHT_COLUMN, _GRAD_OUTPUT_COLUMN = Role.INPUT.index, Role.WEIGHT.index, Role.GRAD_OUTPUT.index


def record_observed_amax(amax_history: torch.Tensor, role: Role, t, bound: bool = False) -> None:
    """Record ``max|t|`` for ``role``; of a tensor that arrived quantized (weight, input or
    grad_output gathered in FP8), this rank's shard amax, which the step's all-reduce makes
    global. ``bound``: a layer's bound call (``t`` of a kind it checks: a plain tensor)."""
    if bound and type(t) is torch.Tensor:
        record_plain_amax(amax_history, role.index, t)
        return
    amax_source = t.fp8_shard_amax if isinstance(t, PrequantizedTensor) else t
    if amax_source is not None:
        record_amax(amax_history, role.index, amax_source)


def reduction_active(group: object | None = None) -> bool:
    """Whether amaxes are reduced: a ``torch.distributed`` group of more than one process
    (asked each time: a process group may be initialized or destroyed at any point)."""
    return _DISTRIBUTED_BUILT and dist.is_initialized() and dist.get_world_size(group) > 1


_WORLD = getattr(dist.distributed_c10d, "_world", None) if _DISTRIBUTED_BUILT else None
TORCH_WORLD = _WORLD if _WORLD is not None and hasattr(_WORLD, "_default_pg") else None
"""torch's own record of the default process group (``TORCH_WORLD._default_pg``, what
``dist.is_initialized`` reads), or ``None`` where this torch keeps none there. A caller that
``torch.compile`` does not trace tells a single process without a call (issue 38) where
``dist.is_initialized is TORCH_IS_INITIALIZED`` (torch's own, not a test's stand-in) and
``TORCH_WORLD._default_pg is None``; else it asks :func:`reduction_active`."""
TORCH_IS_INITIALIZED = dist.is_initialized if _DISTRIBUTED_BUILT else None


def all_reduce_max(tensors: list[torch.Tensor], group: object | None) -> None:
    """All-reduce (MAX) every tensor of ``tensors`` in one collective, in place, NaN kept:
    an element that is NaN on any rank becomes NaN on every rank, as ``torch.maximum`` (one
    process, :func:`record_amax`) gives it.

    No backend's MAX does that: nccl reduces floats with ``fmaxf``, which drops a NaN unless
    every rank has one, and gloo's ``std::max`` keeps or drops it by rank order. So a NaN
    flag per element travels beside the values in the same all-reduce, on the group's
    device (:func:`~fp8train.nn.collective_device.collective_device`).

    A no-op without an initialized process group of size > 1. Every rank must call it with
    tensors of the same shapes in the same order.
    """
    if not reduction_active(group) or not tensors:
        return
    device = collective_device(group)
    values = torch.cat([t.reshape(-1) for t in tensors]).to(device)
    reduced = _reduce_max_keeping_nan(values, group)
    offset = 0
    for t in tensors:
        t.copy_(reduced[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _reduce_max_keeping_nan(values: torch.Tensor, group: object | None) -> torch.Tensor:
    """The MAX over the ranks of 1-D ``values``, NaN where any rank has NaN: the values (a
    NaN sent as -inf, which no MAX drops a value for) and their NaN flags, one all-reduce."""
    nan = values.isnan()
    flagged = torch.cat([torch.where(nan, -math.inf, values), nan.to(values.dtype)])
    dist.all_reduce(flagged, op=dist.ReduceOp.MAX, group=group)
    count = values.numel()
    return torch.where(flagged[count:] > 0, math.nan, flagged[:count])
