"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with FP8 (and 4-bit) all-gather.

``enable_fp8_all_gather(model)`` (before ``fully_shard``) wraps the weight of every
``Float8Linear`` whose recipe allows it in :class:`Float8AllGatherWeight`. FSDP2 then
calls its ``fsdp_pre_all_gather`` on the local shard, which quantizes the shard and hands
FSDP the FP8 bytes (and scales) to gather, and ``fsdp_post_all_gather``, which wraps the
gathered bytes as a :class:`~fp8train.quant.prequantized.PrequantizedTensor`: a weight
whose FP8 operands ``Float8Linear`` feeds to its GEMMs without a second cast.

| recipe | gathered | scales |
|---|---|---|
| tensorwise | E4M3 data | one scale from the MAX of the shards' amaxes (``precompute_fp8_scales_for_fsdp`` after the optimizer step: one collective for all weights; else one per weight at gather time) |
| delayed | E4M3 data | the module's delayed ``fp8_scale`` (identical on every rank); the shard's amax is recorded and all-reduced with the step's other amaxes |
| blockwise | E4M3 data (and, for 1x128 weight blocks, the columnwise copy) | block scales, local to each block: shards must hold whole 128-row blocks |
| mxfp8 | rowwise and columnwise E4M3 data | E8M0 scales, gathered compact; the hardware swizzle happens at GEMM time |
| nvfp4 | E2M1 codes of the 16x16 tiles, packed two a byte along K (the transpose serves grad_input); with ``disable_2d_quantization`` 1x16 rowwise and 16x1 columnwise codes | E4M3 tile (block) scales, gathered compact; the global amax, the MAX of the shards' amaxes (one all-reduce per weight at gather time, or one for all in ``precompute_fp8_scales_for_fsdp``): shards hold whole 16-row tiles |
| mxfp4 | rowwise (1x32) and columnwise (32x1) E2M1 codes, packed two a byte | E8M0 scales, gathered compact: shards hold whole 32-row groups |
| rowwise, rowwise_with_gw_hp | high precision (fallback, logged once) | their columnwise weight scales span all rows, so no shard can compute them |

The gathered payload is uint8 bytes: 1 byte per weight element (half a byte for 4-bit
codes) plus the scales.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ..nn.delayed.amax import tensor_amax
from ..nn.modules.linear import Float8Linear
from ..nn.weights.float8_weight import Float8Weight
from ..log_once import OnceLogger
from ..spec.checks import check_int, check_type
from ..spec.roles import Role
from ..spec.recipes import recipe_label
from .fp8_weight_shard import Float8WeightShard
from .gather import (
    GatherPlan,
    active_recipe,
    gather_inputs,
    gather_plan,
    global_amaxes,
    per_tensor_scales,
    quantize_shard,
    scale_bytes,
    supports_fp8_all_gather,
    unshard_gathered_weight,
)

__all__ = [
    "Float8AllGatherWeight",
    "Float8WeightShard",
    "GatherPlan",
    "gather_plan",
    "enable_fp8_all_gather",
    "precompute_fp8_scales_for_fsdp",
    "supports_fp8_all_gather",
]

logger = logging.getLogger(__name__)
_fallback_log = OnceLogger(__name__)  # which recipes gather their weights in high precision
aten = torch.ops.aten

# Ops through which the sharded weight stays a Float8AllGatherWeight (FSDP2's sharding,
# padding, copies and dtype moves); everything else sees the plain high-precision tensor.
_PRESERVE_SUBCLASS = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.clone.default,
}


def enable_fp8_all_gather(model: nn.Module, shard_world_size: int | None = None) -> nn.Module:
    """Make FSDP2 gather the weights of ``model``'s ``Float8Linear`` modules in FP8 (or 4 bits).

    Call after :func:`~fp8train.convert_to_float8_training` and before ``fully_shard``.
    Recipes where FP8 all-gather does not apply keep a high-precision gather (logged once).

    Args:
        model: the converted model.
        shard_world_size: ranks FSDP2 shards over (default: the world size when a process
            group is initialized; on a 2-D mesh, the data-parallel size), to check that
            block recipes get whole blocks per shard. A weight already split by tensor
            parallelism (a ``DTensor``) is checked, and wrapped, by its local slice.

    Returns:
        ``model``.

    A trainable weight stored in FP8 (``fp8_weights=True``) becomes a
    :class:`~.fp8_weight_shard.Float8WeightShard`: FSDP2 shards its FP8 bytes and gathers
    them as they are (no high-precision shard); build ``fp8train.optim.AdamW`` afterwards,
    on the sharded parameters: it keeps each shard's master and re-quantizes it after each step.

    Raises:
        NotImplementedError: a weight stored in FP8 under a recipe that gathers in high
            precision (rowwise, rowwise_with_gw_hp), or whose shards would not hold whole
            blocks (FSDP2 cannot shard it).
        ValueError: a weight stored in FP8 whose master an optimizer holds already.

    A blockwise (MXFP8, NVFP4, MXFP4) weight whose ``out_features / shard_world_size`` is
    not a multiple of 128 (32, 16, 32) cannot be cut into whole blocks per shard: it keeps a
    high-precision gather (logged).
    """
    check_type("model", model, nn.Module, "an nn.Module")
    check_int("shard_world_size", shard_world_size, minimum=1, allow_none=True)
    if shard_world_size is None:
        shard_world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for name, module in model.named_modules():
        _refuse_unshardable_fp8_weights(name, module)
        if not isinstance(module, Float8Linear) or isinstance(module.weight, Float8AllGatherWeight):
            continue
        gather = gather_plan(module.recipe)
        if isinstance(module.weight, Float8Weight) and module.weight.fp8_master is not None:
            module.weight = nn.Parameter(_fp8_weight_shard(name, module, gather, shard_world_size), requires_grad=True)
            continue
        _wrap_hp_weight(name, module, gather, shard_world_size)
    return model


def _refuse_unshardable_fp8_weights(name: str, module: nn.Module) -> None:
    """Refuse trainable FP8 weights of modules other than ``Float8Linear`` (``Float8Conv1D``,
    ``Float8MultiheadAttention``, ``Float8Experts``): FSDP2 does not shard them."""
    if isinstance(module, Float8Linear):
        return
    for param_name, param in module.named_parameters(recurse=False):
        if isinstance(param, Float8Weight) and param.fp8_master is not None:
            raise NotImplementedError(
                f"{name or 'the model'}.{param_name} ({type(module).__name__}) is stored in FP8 (fp8_weights=True), "
                "which FSDP2 shards for Float8Linear weights only: convert without fp8_weights=True, or leave "
                "this module out of the conversion (module_filter_fn)"
            )


def _wrap_hp_weight(name: str, module: Float8Linear, gather: GatherPlan | None, shard_world_size: int) -> None:
    """Wrap ``module``'s high-precision weight for an FP8 gather where its recipe and
    shards allow one; else leave it to a high-precision gather (logged)."""
    if gather is None:
        _fallback_log.info(
            f"fp8train: FSDP2 gathers {recipe_label(module.recipe)} weights in high precision (their columnwise "
            "scales span every row)"
        )
        return
    rows = gather.rows_multiple
    weight = module.weight
    # Under tensor parallelism FSDP2 shards this rank's slice of the weight.
    local_rows = weight.to_local().shape[0] if isinstance(weight, DTensor) else module.out_features
    if local_rows % (rows * shard_world_size):
        logger.info(
            "fp8train: FSDP2 gathers %s in high precision: out_features=%d over %d ranks does not give "
            "whole %d-row %s blocks per shard (it needs a multiple of %d)",
            name or "the model", local_rows, shard_world_size, rows, recipe_label(module.recipe),
            rows * shard_world_size,
        )
        return
    module.weight = nn.Parameter(_wrap_for_fp8_gather(weight.data), requires_grad=weight.requires_grad)


def _fp8_weight_shard(name: str, module: Float8Linear, gather: GatherPlan | None, shard_world_size: int):
    """``module``'s trainable FP8 weight (``fp8_weights=True``) as one whole
    :class:`~.fp8_weight_shard.Float8WeightShard`, which ``fully_shard`` cuts into rows.

    Raises:
        NotImplementedError: the recipe cannot gather weights in FP8 (rowwise,
            rowwise_with_gw_hp), or the shards would not hold whole scaling blocks.
        ValueError: an optimizer holds the weight's master already.
    """
    where = f"{name or 'the model'} ({recipe_label(module.recipe)}, fp8_weights=True)"
    if gather is None:
        raise NotImplementedError(
            f"{where}: FSDP2 cannot shard a weight stored in FP8 under this recipe (its columnwise scales span "
            "every row, so no shard can be quantized alone): use a recipe that gathers in FP8 (tensorwise, "
            "delayed, blockwise, mxfp8, nvfp4, mxfp4), or convert without fp8_weights=True (FSDP2 then gathers "
            "it in high precision)"
        )
    rows = gather.rows_multiple * shard_world_size
    if module.out_features % rows:
        shards = f"whole {gather.rows_multiple}-row blocks" if gather.rows_multiple > 1 else "as many rows (no padding)"
        raise NotImplementedError(
            f"{where}: out_features={module.out_features} over {shard_world_size} ranks does not give every shard "
            f"{shards} (it needs a multiple of {rows}): pad the layer, or convert it without fp8_weights=True "
            "(module_filter_fn)"
        )
    if module.weight.fp8_master.master is not None:
        raise ValueError(
            f"{where}: an optimizer holds this weight's master already; build fp8train.optim.AdamW after "
            "enable_fp8_all_gather and fully_shard, on the sharded parameters"
        )
    return Float8WeightShard.of_weight(module.weight, gather)


def _wrap_for_fp8_gather(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a :class:`Float8AllGatherWeight`; a tensor-parallel ``DTensor`` keeps its
    layout around a wrapped local slice (what FSDP2 shards and gathers on a 2-D mesh)."""
    if not isinstance(weight, DTensor):
        return Float8AllGatherWeight(weight)
    local = Float8AllGatherWeight(weight.to_local())
    return DTensor.from_local(
        local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
    )


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight (or FSDP2 shard of one) that FSDP2 all-gathers in FP8 (or 4 bits).

    It behaves as its plain tensor everywhere (the optimizer updates it in place); only
    FSDP2's all-gather hooks see the difference.
    """

    _tensor: torch.Tensor
    _precomputed_scale: torch.Tensor | None
    _forward_scale: torch.Tensor | None
    _precomputed_global_amax: tuple[torch.Tensor, torch.Tensor | None] | None

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, precomputed_scale: torch.Tensor | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, precomputed_scale: torch.Tensor | None = None) -> None:
        self._tensor = tensor
        self._precomputed_scale = precomputed_scale
        self._forward_scale = None  # the last forward gather's, for backward
        self._precomputed_global_amax = None  # NVFP4: precompute_fp8_scales_for_fsdp's, used once

    def high_precision(self) -> torch.Tensor:
        """The plain high-precision tensor this wraps (e.g. for a checkpoint)."""
        return self._tensor

    def precompute(
        self, scale: torch.Tensor | None = None, global_amax: tuple[torch.Tensor, torch.Tensor | None] | None = None
    ) -> None:
        """Hand the next forward all-gather its per-tensor ``scale``, or NVFP4's
        ``global_amax`` per usage, computed for all weights at once
        (:func:`precompute_fp8_scales_for_fsdp`); used once."""
        if scale is not None:
            self._precomputed_scale = scale
        if global_amax is not None:
            self._precomputed_global_amax = global_amax

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.detach.default:
            return cls(args[0]._tensor.detach(), args[0]._precomputed_scale)
        unwrapped_args, unwrapped_kwargs = tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if func not in _PRESERVE_SUBCLASS:
            return out
        return tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, metadata, outer_size, outer_stride):
        return Float8AllGatherWeight(inner_tensors["_tensor"])

    # ------------------------------------------------------------------ FSDP2 hooks
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) -> tuple[tuple, Any]:
        recipe = active_recipe(module)
        gather = gather_plan(recipe)
        shard = self._tensor
        param_dtype = getattr(mp_policy, "param_dtype", None) or shard.dtype
        shard = shard.to(param_dtype)
        if gather.per_tensor:
            return self._pre_all_gather_per_tensor(shard, gather, module, mesh)
        rows = gather.rows_multiple
        if shard.shape[0] % rows:
            raise ValueError(
                f"FSDP2 shard of shape {tuple(shard.shape)} of {module} does not hold whole {rows}-row blocks: "
                f"out_features={outer_size[0]} over {mesh.size()} ranks must give a multiple of {rows} rows per rank"
            )
        rowwise, columnwise = quantize_shard(gather, shard, global_amax=self._global_amax(gather, shard, mesh))
        inputs = [rowwise.data.view(torch.uint8), scale_bytes(rowwise.scale_inv)]
        if columnwise is not None:  # its own quantization, gathered compact (axis 0)
            inputs += [columnwise.data.view(torch.uint8), scale_bytes(columnwise.scale_inv)]
        global_amax = rowwise.global_amax, None if columnwise is None else columnwise.global_amax
        return gather_inputs(inputs, (gather, rowwise.dtype, None, rowwise.power_2_scales, None, global_amax), mesh)

    def _global_amax(self, gather: GatherPlan, shard, mesh) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """NVFP4: the whole weight's global amax per gathered usage, the MAX of the shards'
        (:func:`~.gather.global_amaxes`), precomputed or reduced now; ``None`` otherwise.
        The weight does not change between a forward and its backward, so the backward's
        re-gather reduces to the same value."""
        if not gather.global_amax:
            return None
        if self._precomputed_global_amax is not None:
            global_amax, self._precomputed_global_amax = self._precomputed_global_amax, None  # used once
            # Of the stored weight; the shard was cast to the parameter dtype since. Rounding
            # is monotonic, so the cast's amax is the amax cast (no transform on weights).
            return tuple(None if a is None else a.to(shard.dtype).to(torch.float32) for a in global_amax)
        return global_amaxes([shard], [gather], mesh.get_group() if mesh is not None else None)[0]

    def _pre_all_gather_per_tensor(self, shard, gather: GatherPlan, module, mesh) -> tuple[tuple, Any]:
        """One scale for the whole weight; the shard's amax travels with the gathered
        weight for delayed scaling to record (FSDP2 gathers under no_grad)."""
        op = gather.rowwise
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and self._forward_scale is not None:
            # The re-gather for backward must reproduce the forward's weight (delayed
            # scales may have been updated since, at the autocast exit).
            scale = self._forward_scale
        elif gather.delayed:
            scale = module.fp8_scale[Role.WEIGHT.index].detach().clone()
        elif self._precomputed_scale is not None:
            scale, self._precomputed_scale = self._precomputed_scale, None  # used once
        else:
            scale = per_tensor_scales([shard], [gather], mesh.get_group() if mesh is not None else None)[0]
        if not in_backward:
            self._forward_scale = scale
        qt, _ = quantize_shard(gather, shard, scale)
        shard_amax = tensor_amax(shard) if shard.numel() else None
        metadata = (gather, qt.dtype, qt.scale_inv, op.power_2_scales, shard_amax, (None, None))
        return gather_inputs([qt.data.view(torch.uint8)], metadata, mesh)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return unshard_gathered_weight(all_gather_outputs, metadata, param_dtype, out)


def precompute_fp8_scales_for_fsdp(model: nn.Module, group=None) -> None:
    """After the optimizer step: compute the FP8 scale of every per-tensor (current
    scaling) weight from the MAX of its shards' amaxes in one batched all-reduce, and
    NVFP4's global amax of every weight in another, for the next all-gather to use.

    ``group``: the ranks FSDP2 shards over (default: the world, or on a 2-D mesh its first,
    data-parallel dim, where each tensor-parallel rank's slice has its own scale)."""
    check_type("model", model, nn.Module, "an nn.Module")
    shards, gathers = [], []
    for module in model.modules():
        if not isinstance(module, Float8Linear):
            continue
        gather = gather_plan(active_recipe(module))
        if gather is None or not (gather.per_tensor or gather.global_amax) or gather.delayed:
            continue
        if any(op.rule.rht for op in (gather.rowwise, gather.columnwise) if op is not None):
            continue  # its amax is of the transformed weight: reduced at gather time
        weight = module.weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        if isinstance(local, Float8AllGatherWeight):
            shards.append(local)
            gathers.append(gather)
            if group is None and isinstance(weight, DTensor) and weight.device_mesh.ndim > 1:
                group = weight.device_mesh.get_group(0)
    per_tensor = [(shard, gather) for shard, gather in zip(shards, gathers) if gather.per_tensor]
    if per_tensor:
        scales = per_tensor_scales([shard.high_precision() for shard, _ in per_tensor], [g for _, g in per_tensor], group)
        for (shard, _), scale in zip(per_tensor, scales):
            shard.precompute(scale=scale)
    two_level = [(shard, gather) for shard, gather in zip(shards, gathers) if gather.global_amax]
    if two_level:
        amaxes = global_amaxes([shard.high_precision() for shard, _ in two_level], [g for _, g in two_level], group)
        for (shard, _), global_amax in zip(two_level, amaxes):
            shard.precompute(global_amax=global_amax)
