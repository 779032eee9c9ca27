"""Sequence parallelism's FP8 (and 4-bit) all-gather: a Linear layer's input (forward) or
grad_output (backward) sharded along a token dim, quantized shard by shard and gathered
across the tensor-parallel group as FP8 bytes (packed E2M1 codes) and compact scales; the
GEMM operands are assembled after the gather, as a
:class:`~fp8train.quant.prequantized.PrequantizedTensor`.

What each rank quantizes, from the recipe's plan (:func:`~.gather.gather_plan` of the role):

* a per-tensor scale: current scaling all-reduces (MAX) the shards' amaxes over the group
  first, so every rank quantizes with the whole tensor's scale; delayed scaling uses the
  stored scale (identical on every rank: its amaxes are all-reduced at each step's end),
  and records this rank's shard amax;
* block and MX scales are local to their groups: each rank quantizes its shard (both
  usages, where the backward needs its own columnwise copy) and the compact data and
  scales are gathered. A shard must then hold whole groups: a multiple of the group's
  rows in every stretch of consecutive tokens;
* NVFP4's block scales sit under a global amax per usage: each usage's shard amax (after
  the Hadamard transform, for the grad_weight GEMM's columnwise copy) is all-reduced MAX
  over the group first, in one collective (Transformer Engine's NVFP4 amax reduction over
  the tensor-parallel group), so every rank quantizes under the whole tensor's.

Either way the gathered operands are bit-equal to quantizing the gathered high-precision
tensor in one process (but for stochastic rounding, whose draws are each rank's own). The gradient of a gather (a partial sum on each rank) is
reduce-scattered in high precision, and the reduce-scatter of a row-parallel layer's
output stays in high precision in the forward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ..nn.autocast import current_state
from ..nn.delayed.amax import tensor_amax
from ..log_once import OnceLogger
from ..quant.prequantized import PrequantizedTensor
from ..quant.tensor import QuantizedTensor, transpose
from ..spec.recipes import Recipe, recipe_label
from ..spec.roles import Role
from .gather import GatherPlan, active_recipe, gather_plan, global_amaxes, per_tensor_scales, quantize_shard

__all__ = [
    "activation_gather_plan",
    "all_gather_fp8",
    "gather_activation",
    "reduce_scatter_output",
]

_fallback_log = OnceLogger(__name__)  # why a gather falls back to high precision


def activation_gather_plan(
    recipe: Recipe, role: Role, shard_shape: tuple[int, ...], dim: int, world_size: int
) -> tuple[GatherPlan | None, str | None]:
    """How ``recipe`` gathers a ``role`` (input or grad_output) shard of ``shard_shape``
    along ``dim`` over ``world_size`` ranks: ``(plan, None)`` in FP8, or ``(None, reason)``
    in high precision.

    FP8 needs: a plan for the role (:func:`~.gather.gather_plan`); a token dim (not the
    last, feature dim); whole scaling groups in every stretch of consecutive tokens of a
    shard; features that tile the recipe's block; and a gathered token count that is a
    multiple of the recipe's alignment (which the layer would otherwise pad).
    """
    gather = gather_plan(recipe, role)
    name = f"{recipe_label(recipe)} {role.value}"
    if gather is None:
        return None, (
            f"{name}: gathered in high precision (a scale of the grad_weight GEMM spans every token, or that GEMM "
            "runs in high precision and needs the high-precision tensor)"
        )
    ndim = len(shard_shape)
    dim = dim % ndim if ndim else dim
    if ndim < 2 or dim == ndim - 1:
        return None, f"{name}: gathered in high precision (sharded along its last, feature dim {dim})"
    tokens_per_stretch = math.prod(shard_shape[dim:-1])
    if tokens_per_stretch % gather.rows_multiple:
        return None, (
            f"{name}: gathered in high precision (a shard of shape {tuple(shard_shape)} split along dim {dim} holds "
            f"{tokens_per_stretch} consecutive tokens, not whole {gather.rows_multiple}-token scaling groups)"
        )
    plan = gather.plan
    tokens = math.prod(shard_shape[:-1]) * world_size
    if tokens % plan.alignment or (plan.block and shard_shape[-1] % plan.block):
        return None, (
            f"{name}: gathered in high precision ({tokens} tokens x {shard_shape[-1]} features do not meet the "
            f"recipe's alignment of {plan.alignment})"
        )
    return gather, None


def all_gather_fp8(
    shard_hp: torch.Tensor, gather: GatherPlan, dim: int, group, scale: torch.Tensor | None = None
) -> PrequantizedTensor:
    """Quantize ``shard_hp`` as ``gather`` says and all-gather it along ``dim`` in FP8 (or 4 bits).

    Args:
        shard_hp: this rank's shard; every rank's has the same shape, and ``gather`` holds
            for it (:func:`activation_gather_plan`).
        gather: the role's plan.
        dim: the token dim the shards are cut along.
        group: the tensor-parallel process group.
        scale: delayed scaling's stored scale (identical on every rank); ``None``
            otherwise (a per-tensor scale then comes from the MAX of the shards' amaxes,
            and NVFP4's global amaxes likewise, reduced here).

    Returns:
        The whole tensor's quantized operands (data and scales bit-equal to quantizing
        the gathered tensor in one process, stochastic rounding's draws aside), with a
        high-precision face of ``shard_hp``'s dtype.
    """
    world = dist.get_world_size(group)
    dim = dim % shard_hp.dim()
    if gather.per_tensor and scale is None:
        scale = per_tensor_scales([shard_hp], [gather], group)[0]
    global_amax = global_amaxes([shard_hp], [gather], group)[0] if gather.global_amax else None
    rowwise, columnwise = quantize_shard(gather, shard_hp, scale, global_amax)
    parts = [rowwise.data] + ([] if gather.per_tensor else [rowwise.scale_inv])
    if columnwise is not None:
        parts += [columnwise.data, columnwise.scale_inv]
    gathered = _all_gather_parts(parts, group, world)
    outer = math.prod(shard_hp.shape[:dim])  # stretches of consecutive tokens per shard
    shape = (*shard_hp.shape[:dim], shard_hp.shape[dim] * world, *rowwise.data.shape[dim + 1 :])
    data = _interleave(gathered.pop(0), outer).reshape(shape)
    scale_inv = rowwise.scale_inv if gather.per_tensor else _interleave(gathered.pop(0), outer)
    rowwise_full = QuantizedTensor(
        data=data, scale_inv=scale_inv, granularity=rowwise.granularity, axis=rowwise.axis,
        power_2_scales=rowwise.power_2_scales, global_amax=rowwise.global_amax,
    )
    columnwise_full = None
    if columnwise is not None:
        columnwise_data = _interleave(gathered.pop(0), outer)  # 4-bit: the 2-D view, token pairs a byte
        columnwise_full = transpose(
            QuantizedTensor(
                data=columnwise_data if columnwise.granularity.fp4 else columnwise_data.reshape(shape),
                scale_inv=_interleave(gathered.pop(0), outer),
                granularity=columnwise.granularity,
                axis=columnwise.axis,
                power_2_scales=columnwise.power_2_scales,
                global_amax=columnwise.global_amax,
            )
        )
    shard_amax = tensor_amax(shard_hp) if gather.delayed else None
    return PrequantizedTensor(rowwise_full, columnwise_full, shard_hp.dtype, shard_amax)


def _all_gather_parts(parts: list[torch.Tensor], group, world: int) -> list[torch.Tensor]:
    """All-gather every tensor of ``parts`` in one collective, as bytes: each comes back
    ``[world, *shape]`` in its own dtype, rank-major."""
    flat = [p.contiguous().view(torch.uint8).reshape(-1) for p in parts]
    send = torch.cat(flat)
    received = torch.empty(world * send.numel(), dtype=torch.uint8, device=send.device)
    dist.all_gather_into_tensor(received, send, group=group)
    received = received.view(world, send.numel())
    out, offset = [], 0
    for part, part_bytes in zip(parts, flat):
        chunk = received[:, offset : offset + part_bytes.numel()].contiguous()
        out.append(chunk.view(part.dtype).reshape(world, *part.shape))
        offset += part_bytes.numel()
    return out


def _interleave(gathered: torch.Tensor, outer: int) -> torch.Tensor:
    """``[world, *shape]`` (rank-major; each rank's 2-D view ``rows x cols``, its rows
    ``outer`` stretches of consecutive tokens or token groups) -> ``[world * rows, cols]``
    in the order of the whole tensor: stretch by stretch, rank by rank within each."""
    if gathered.dtype == torch.float4_e2m1fn_x2:  # PyTorch (2.13) cannot copy every 4-bit layout: move bytes
        return _interleave(gathered.view(torch.uint8), outer).view(gathered.dtype)
    world, cols = gathered.shape[0], gathered.shape[-1]
    stretches = gathered.reshape(world, outer, -1, cols).transpose(0, 1)
    return stretches.reshape(-1, cols)


def _reduce_scatter(partial: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Sum the ranks' ``partial`` tensors and keep this rank's ``dim`` shard (high precision)."""
    summed = DTensor.from_local(partial, mesh, (Partial(),), run_check=False)
    return summed.redistribute(mesh, (Shard(dim),)).to_local()


class _AllGatherFloat8(torch.autograd.Function):
    """Forward: :func:`all_gather_fp8`. Backward: the gradient, a partial sum on each rank
    (each rank's GEMMs use their own slice of the weight), reduce-scattered along ``dim``."""

    @staticmethod
    def forward(ctx, shard_hp, gather, dim, mesh, scale):
        ctx.mesh, ctx.dim = mesh, dim
        return all_gather_fp8(shard_hp, gather, dim, mesh.get_group(), scale)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter(grad_output, ctx.mesh, ctx.dim), None, None, None, None


class _ReduceScatterGatherGradFloat8(torch.autograd.Function):
    """Forward: reduce-scatter a row-parallel layer's partial output along ``dim`` (high
    precision). Backward: the gradient (this rank's shard) all-gathered in FP8 as the
    layer's grad_output, with delayed scaling's grad_output scale of ``owner``."""

    @staticmethod
    def forward(ctx, partial_hp, mesh, dim, gather, owner):
        ctx.mesh, ctx.dim, ctx.gather, ctx.owner = mesh, dim, gather, owner
        return _reduce_scatter(partial_hp, mesh, dim)

    @staticmethod
    def backward(ctx, grad_output):
        scale = _delayed_scale(ctx.owner, Role.GRAD_OUTPUT) if ctx.gather.delayed else None
        gathered = all_gather_fp8(grad_output.contiguous(), ctx.gather, ctx.dim, ctx.mesh.get_group(), scale)
        return gathered, None, None, None, None


def _delayed_scale(owner: nn.Module, role: Role) -> torch.Tensor:
    return owner.fp8_scale[role.index].detach().clone()


def _fp8_enabled() -> bool:
    state = current_state()
    return state is None or state.enabled


def _check_delayed(recipe: Recipe, owner: nn.Module | None, what: str) -> str | None:
    """Delayed scaling gathers with the stored scale, which every rank must hold alike.
    Raises where it cannot; returns a reason to gather in high precision where the owner
    has no state yet."""
    if not recipe.reduce_amax:
        raise ValueError(
            f"{what}: {recipe_label(recipe)} with reduce_amax=False cannot gather sequence-parallel activations in FP8 "
            "(each rank would hold its own scale); use reduce_amax=True"
        )
    if torch.is_grad_enabled() and current_state() is None:
        raise RuntimeError(
            f"{what}: delayed scaling with sequence parallelism must train inside fp8train.autocast(), whose exit "
            "all-reduces the step's amaxes so that every rank holds the same scales"
        )
    if owner is None or getattr(owner, "fp8_scale", None) is None:
        return f"{what}: in high precision (no module with delayed-scaling state to take the scale from)"
    return None


def _fp8_gather(
    recipe: Recipe, role: Role, shard_shape: tuple[int, ...], dim: int, mesh: DeviceMesh, owner: nn.Module | None
) -> GatherPlan | None:
    """:func:`activation_gather_plan`, with delayed scaling's conditions; ``None`` (gather
    in high precision) logs why, once."""
    gather, reason = activation_gather_plan(recipe, role, shard_shape, dim, mesh.size())
    if gather is not None and gather.delayed:
        reason = _check_delayed(recipe.delayed_scaling, owner, f"the {role.value} gather")
        gather = None if reason else gather
    if reason:
        _fallback_log.info(f"fp8train: sequence parallel: {reason}")
    return gather


def gather_activation(
    shard: torch.Tensor, placement: Placement, mesh: DeviceMesh, owner: nn.Module | None, recipe: Recipe | None
) -> DTensor:
    """All-gather a Linear layer's input, sharded as ``placement``, to a replicated
    ``DTensor``: in FP8 for ``recipe`` (the active one of ``owner`` when ``None``) where
    :func:`activation_gather_plan` allows, else in high precision (logged once).

    The result's gradient is expected as a partial sum per rank and reduce-scattered.
    Delayed scaling takes the scale of ``owner`` (a module with delayed-scaling state).
    """
    gather = None
    if isinstance(placement, Shard) and _fp8_enabled() and (owner is not None or recipe is not None):
        state = current_state()
        if state is not None and state.recipe is not None:
            recipe = state.recipe
        elif recipe is None:
            recipe = active_recipe(owner)
        gather = _fp8_gather(recipe, Role.INPUT, tuple(shard.shape), placement.dim, mesh, owner)
    if gather is None:
        hp = DTensor.from_local(shard, mesh, (placement,), run_check=False)
        return hp.redistribute(mesh, (Replicate(),))
    device_type = shard.device.type
    if torch.is_autocast_enabled(device_type):  # quantize what the layer would: the cast input
        shard = shard.to(torch.get_autocast_dtype(device_type))
    scale = _delayed_scale(owner, Role.INPUT) if gather.delayed else None
    full = _AllGatherFloat8.apply(shard, gather, placement.dim, mesh, scale)
    return DTensor.from_local(full, mesh, (Replicate(),), run_check=False, grad_placements=(Partial(),))


def reduce_scatter_output(partial: torch.Tensor, placement: Placement, mesh: DeviceMesh, owner: nn.Module) -> DTensor:
    """A row-parallel layer's partial output (each rank's GEMM over its slice of the
    features), summed across ranks into ``placement``. Into a token-dim ``Shard``
    (sequence parallel) the backward all-gathers the gradient in FP8 as the layer's
    grad_output, where :func:`activation_gather_plan` allows (else high precision, logged
    once); the forward's reduction stays in high precision."""
    gather = None
    if isinstance(placement, Shard) and _fp8_enabled():
        dim = placement.dim % partial.dim()
        shard_shape = list(partial.shape)
        shard_shape[dim] //= mesh.size()
        gather = _fp8_gather(active_recipe(owner), Role.GRAD_OUTPUT, tuple(shard_shape), dim, mesh, owner)
    if gather is None:
        summed = DTensor.from_local(partial, mesh, (Partial(),), run_check=False)
        return summed.redistribute(mesh, (placement,))
    local = _ReduceScatterGatherGradFloat8.apply(partial, mesh, placement.dim, gather, owner)
    return DTensor.from_local(local, mesh, (placement,), run_check=False)
