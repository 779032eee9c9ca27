"""Quantize a shard and gather it in FP8 (or 4 bits): what FSDP2's weight all-gather
(:mod:`.fsdp`) and sequence parallelism's activation all-gather (:mod:`.sequence_gather`) share.

A tensor split across ranks can be gathered quantized when every rank can compute, from its
own shard, the scales the whole tensor would get: a per-tensor scale (from the MAX of the
shards' amaxes, or delayed scaling's stored scale), or scaling groups that never span two
shards (whole blocks per shard), under, for NVFP4, the whole tensor's global amax (the MAX
of the shards', after the transform where a usage has one). :func:`gather_plan` reads that
from the recipe's operand plan; nothing here looks at the recipe's type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..nn.autocast import current_state
from ..nn.delayed.amax import all_reduce_max, tensor_amax
from ..quant.cast import scale_dtype
from ..quant.hadamard import random_hadamard_transform
from ..quant.prequantized import PrequantizedTensor
from ..quant.quantize import quantize
from ..quant.scaling import amax_to_scale
from ..quant.tensor import QuantizedTensor, transpose
from ..spec.plan import Operand, OperandPlan
from ..spec.recipes import Recipe
from ..spec.roles import Role

__all__ = [
    "GatherPlan",
    "gather_plan",
    "supports_fp8_all_gather",
    "active_recipe",
    "per_tensor_scales",
    "global_amaxes",
    "quantize_shard",
    "scale_bytes",
    "gather_inputs",
    "unshard_gathered_weight",
]


@dataclass(frozen=True)
class GatherPlan:
    """How one role of a recipe (its weight, input or grad_output) is gathered in FP8 or 4 bits.

    Attributes:
        plan: the recipe's operand plan.
        rowwise: the role's last-dim slot (the output GEMM's for the weight and input, the
            grad_input GEMM's for grad_output), quantized shard by shard and gathered.
        columnwise: the role's first-dim slot when it is its own quantization (gathered
            too, compact, along axis 0), ``None`` when the transpose of ``rowwise`` serves.
        rows_multiple: each shard must hold a multiple of this many rows of the tensor's
            2-D view (per stretch of consecutive rows), so that no scaling group spans two
            shards (1 for a per-tensor scale).
    """

    plan: OperandPlan
    rowwise: Operand
    columnwise: Operand | None
    rows_multiple: int

    @property
    def per_tensor(self) -> bool:
        """One scale for the whole tensor: from the MAX of every shard's amax, or from
        delayed scaling's state."""
        return self.rowwise.granularity.per_tensor

    @property
    def delayed(self) -> bool:
        """The gathered slot's scale is delayed scaling's stored one (every rank's the same),
        not computed from the shards (a mixture may delay another role's slots only)."""
        return self.rowwise.delayed

    @property
    def global_amax(self) -> bool:
        """NVFP4's two-level scales: every shard quantizes under the whole tensor's global
        amax (:func:`global_amaxes`), one per gathered usage."""
        return self.rowwise.granularity.two_level_scales


def gather_plan(recipe: Recipe, role: Role = Role.WEIGHT) -> GatherPlan | None:
    """The :class:`GatherPlan` of ``recipe``'s ``role`` (default: the weight, as FSDP2
    gathers it), or ``None`` when it is gathered in high precision:

    * a shard cannot compute its own scales: a group that spans every row (e.g. rowwise's
      per-column scales of the grad_input GEMM's weight, or of the grad_weight GEMM's
      input and grad_output), or a per-tensor scale beside per-row ones;
    * the backward needs the tensor in high precision: its grad_weight GEMM slot is not
      quantized (``rowwise_with_gw_hp``'s input and grad_output);
    * two per-tensor slots that are not one quantization (a mixture of a current-scaled and
      a delayed direction: two scales).

    4-bit roles gather packed E2M1 codes and block scales like the FP8 block recipes (NVFP4
    under the MAX of the shards' global amaxes: :func:`global_amaxes`).
    """
    plan = recipe.operand_plan
    usages = plan.usages_of(role)
    if len(usages) < 2:
        return None
    if all(op.granularity.per_tensor for op in usages):
        return GatherPlan(plan, usages[0], None, 1) if plan.reuses_last_dim(usages[1].usage) else None
    rows = [op.granularity.rows_per_group(op.axis) for op in usages]
    if any(op.granularity.per_tensor for op in usages) or None in rows:
        return None
    first = usages[1]
    columnwise = None if plan.reuses_last_dim(first.usage) else first
    return GatherPlan(plan, usages[0], columnwise, math.lcm(*rows))


def supports_fp8_all_gather(recipe: Recipe, role: Role = Role.WEIGHT) -> bool:
    """Whether ``role`` (default: the weight) of ``recipe`` can be quantized shard by shard
    and gathered in FP8 (or 4 bits)."""
    return gather_plan(recipe, role) is not None


def active_recipe(module: nn.Module) -> Recipe:
    """The recipe ``module``'s matmuls run now: an enclosing ``fp8train.autocast``'s
    override, else the module's own."""
    state = current_state()
    return state.recipe if state is not None and state.recipe is not None else module.recipe


def per_tensor_scales(shards: list[torch.Tensor], gathers: list[GatherPlan], group) -> list[torch.Tensor]:
    """Per-tensor scales of whole tensors from the MAX of their shards' amaxes: one
    all-reduce over ``group`` for all of them (none without a process group). A NaN on
    any rank gives every rank the scale of a NaN amax, as the whole tensor's would."""
    amaxes = torch.stack([tensor_amax(s) for s in shards])
    all_reduce_max([amaxes], group)
    return [
        amax_to_scale(
            amax,
            gather.rowwise.rule.fp8_max,
            power_2_scales=gather.rowwise.rule.power_2_scales,
            amax_epsilon=gather.rowwise.rule.amax_epsilon,
        )
        for amax, gather in zip(amaxes.unbind(), gathers)
    ]


def global_amaxes(
    shards: list[torch.Tensor], gathers: list[GatherPlan], group
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """NVFP4's global amaxes of whole tensors from their shards (every plan's
    :attr:`GatherPlan.global_amax` true): per tensor, ``(rowwise, columnwise)``, each the
    MAX over the ranks of ``group`` of the shard's amax after its usage's transform
    (``rule.rht``; the two differ where one usage has it), ``None`` where the columnwise
    copy is not gathered. One all-reduce for all (none without a process group); a NaN on
    any rank gives NaN, as the whole tensor's amax would be."""
    local = []
    for shard, gather in zip(shards, gathers):
        ops = [gather.rowwise] + ([] if gather.columnwise is None else [gather.columnwise])
        local += [tensor_amax(random_hadamard_transform(shard, op.axis) if op.rule.rht else shard) for op in ops]
    amaxes = torch.stack(local)
    all_reduce_max([amaxes], group)
    reduced = amaxes.unbind()
    out, index = [], 0
    for gather in gathers:
        columnwise = None if gather.columnwise is None else reduced[index + 1]
        out.append((reduced[index], columnwise))
        index += 1 if columnwise is None else 2
    return out


def quantize_shard(
    gather: GatherPlan,
    shard: torch.Tensor,
    scale: torch.Tensor | None = None,
    global_amax: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    """``(rowwise, columnwise)`` of one shard, as they travel: both in the shard's
    orientation (``columnwise`` with ``axis=0``, not transposed; ``None`` where the
    transpose of ``rowwise`` serves). ``scale``: the per-tensor scale (required for a
    per-tensor plan, which every rank must share). ``global_amax``: NVFP4's, per usage
    (:func:`global_amaxes`: required for an NVFP4 plan, and every rank's the same)."""
    rowwise_amax, columnwise_amax = global_amax if global_amax is not None else (None, None)
    op = gather.rowwise
    rowwise = quantize(shard, op.rule, axis=op.axis, scale=scale, global_amax=rowwise_amax)
    if gather.per_tensor and not gather.delayed and gather.rowwise.power_2_scales:
        # A computed power-of-two scale: say so, as a scale computed in place would.
        rowwise = QuantizedTensor(
            data=rowwise.data, scale_inv=rowwise.scale_inv, granularity=rowwise.granularity,
            axis=rowwise.axis, power_2_scales=True,
        )
    columnwise = None
    if gather.columnwise is not None:
        op = gather.columnwise
        columnwise = quantize(shard, op.rule, axis=op.axis, global_amax=columnwise_amax)
    return rowwise, columnwise


def scale_bytes(scale_inv: torch.Tensor) -> torch.Tensor:
    """``scale_inv`` as uint8 bytes (float32, E8M0 or E4M3), for a byte-wise collective."""
    return scale_inv.contiguous().view(torch.uint8)


def gather_inputs(inputs: list[torch.Tensor], metadata: tuple, mesh) -> tuple[tuple, tuple]:
    """FSDP2's ``fsdp_pre_all_gather`` result for a weight's uint8 ``inputs``: as they are,
    or, where FSDP2 shards over one rank, packed into one flat buffer, its pieces' shapes
    appended to ``metadata`` (``None`` there when not packed).

    A world of one skips the all-gather: FSDP2 (torch 2.10 to 2.14) then copies only a
    parameter's first input into its output, and the rest (block scales, the columnwise
    copy) would be lost. A buffer of one costs one copy of the shard's bytes."""
    if len(inputs) == 1 or mesh is None or mesh.size(-1) > 1:
        return tuple(inputs), (*metadata, None)
    shapes = tuple(tuple(t.shape) for t in inputs)
    return (torch.cat([t.reshape(-1) for t in inputs]),), (*metadata, shapes)


def _unpacked(all_gather_outputs, shapes) -> list[torch.Tensor]:
    """The pieces of a buffer :func:`gather_inputs` packed (views), or the outputs as they are."""
    if shapes is None:
        return list(all_gather_outputs)
    pieces = all_gather_outputs[0].split([math.prod(shape) for shape in shapes])
    return [piece.view(shape) for piece, shape in zip(pieces, shapes)]


def unshard_gathered_weight(all_gather_outputs, metadata, param_dtype: torch.dtype, out=None):
    """FSDP2's ``fsdp_post_all_gather`` of a weight gathered in FP8 (or 4 bits): the
    gathered bytes as a :class:`~fp8train.quant.prequantized.PrequantizedTensor` of face
    dtype ``param_dtype``, and the tensors FSDP2 frees after use; with ``out`` (FSDP2's
    unsharded tensor, reused after the first gather) its payload is replaced in place and
    ``None`` returned.

    ``all_gather_outputs``: the rowwise data (and, where its scales are per block, their
    bytes), then the columnwise data and scale bytes where ``gather.columnwise`` is its own;
    ``metadata``: ``(gather, data dtype, per-tensor scale_inv or None, power_2_scales,
    shard amax or None, (rowwise global amax, columnwise global amax), packed shapes or
    None)``, the last from :func:`gather_inputs`."""
    gather, fp8_dtype, scale_inv, power_2, shard_amax, global_amaxes_, packed_shapes = metadata
    global_amax, columnwise_global_amax = global_amaxes_
    parts = _unpacked(all_gather_outputs, packed_shapes)
    granularity = gather.rowwise.granularity
    data = parts[0].view(fp8_dtype)
    if scale_inv is None:
        scale_inv = parts[1].view(scale_dtype(granularity))
    rowwise = QuantizedTensor(
        data=data, scale_inv=scale_inv, granularity=granularity, axis=-1, power_2_scales=power_2,
        global_amax=global_amax,
    )
    columnwise = None
    if gather.columnwise is not None:
        columnwise = transpose(
            QuantizedTensor(
                data=parts[2].view(fp8_dtype),
                scale_inv=parts[3].view(scale_dtype(gather.columnwise.granularity)),
                granularity=gather.columnwise.granularity,
                axis=gather.columnwise.axis,
                power_2_scales=power_2,
                global_amax=columnwise_global_amax,
            )
        )
    if out is not None:  # FSDP2 reuses its unsharded tensor (a DTensor's local one on a 2-D mesh)
        (out._local_tensor if isinstance(out, DTensor) else out).set_payload(rowwise, columnwise, shard_amax)
        return None
    return PrequantizedTensor(rowwise, columnwise, param_dtype, shard_amax), tuple(all_gather_outputs)
