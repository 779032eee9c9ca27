"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with FP8 all-gather.

``enable_fp8_all_gather(model)`` (before ``fully_shard``) wraps the weight of every
``Float8Linear`` whose recipe allows it in :class:`Float8AllGatherWeight`. FSDP2 then
calls its ``fsdp_pre_all_gather`` on the local shard, which quantizes the shard and hands
FSDP the FP8 bytes (and scales) to gather, and ``fsdp_post_all_gather``, which wraps the
gathered bytes as :class:`Float8GatheredWeight`: a weight that ``Float8Linear`` feeds to
its GEMMs without a second cast.

| recipe | gathered | scales |
|---|---|---|
| tensorwise | E4M3 data | one scale from the MAX of the shards' amaxes (``precompute_fp8_scales_for_fsdp`` after the optimizer step: one collective for all weights; else one per weight at gather time) |
| delayed | E4M3 data | the module's delayed ``fp8_scale`` (identical on every rank); the shard's amax is recorded and all-reduced with the step's other amaxes |
| blockwise | E4M3 data (and, for 1x128 weight blocks, the columnwise copy) | block scales, local to each block: shards must hold whole 128-row blocks |
| mxfp8 | rowwise and columnwise E4M3 data | E8M0 scales, gathered compact; the hardware swizzle happens at GEMM time |
| rowwise, rowwise_with_gw_hp | high precision (fallback, logged once) | their columnwise weight scales span all rows, so no shard can compute them |

The gathered payload is uint8 bytes: 1 byte per weight element plus the scales.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from .delayed import WEIGHT
from .formats import format_of
from .gemm import transpose
from .linear import Float8Linear
from .quantize import QuantizedTensor, quantize
from .recipes import BlockScaling, DelayedScaling, MXFP8Scaling, Recipe, TensorwiseScaling
from .scaling import amax_to_scale

__all__ = [
    "Float8AllGatherWeight",
    "Float8GatheredWeight",
    "enable_fp8_all_gather",
    "precompute_fp8_scales_for_fsdp",
    "supports_fp8_all_gather",
]

logger = logging.getLogger(__name__)
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


def supports_fp8_all_gather(recipe: Recipe) -> bool:
    """Whether a weight of ``recipe`` can be quantized shard by shard and gathered in FP8."""
    return isinstance(recipe, (TensorwiseScaling, DelayedScaling, BlockScaling, MXFP8Scaling))


@functools.lru_cache(maxsize=None)
def _log_fallback_once(recipe_name: str) -> None:
    logger.info(
        "fp8train: FSDP2 gathers %s weights in high precision (their columnwise scales span every row)",
        recipe_name,
    )


def enable_fp8_all_gather(model: nn.Module, shard_world_size: int | None = None) -> nn.Module:
    """Make FSDP2 gather the weights of ``model``'s ``Float8Linear`` modules in FP8.

    Call after :func:`~fp8train.convert_to_float8_training` and before ``fully_shard``.
    Recipes where FP8 all-gather does not apply keep a high-precision gather (logged once).

    Args:
        model: the converted model.
        shard_world_size: ranks FSDP2 shards over (default: the world size when a process
            group is initialized), to check that block recipes get whole blocks per shard.

    Returns:
        ``model``.

    A blockwise (MXFP8) weight whose ``out_features / shard_world_size`` is not a multiple
    of 128 (32) cannot be cut into whole blocks per shard: it keeps a high-precision gather
    (logged).
    """
    if shard_world_size is None:
        shard_world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for name, module in model.named_modules():
        if not isinstance(module, Float8Linear) or isinstance(module.weight, Float8AllGatherWeight):
            continue
        if not supports_fp8_all_gather(module.recipe):
            _log_fallback_once(module.recipe.name)
            continue
        block = getattr(module.recipe, "block_size", 1)
        if module.out_features % (block * shard_world_size):
            logger.info(
                "fp8train: FSDP2 gathers %s in high precision: out_features=%d over %d ranks does not give "
                "whole %d-row %s blocks per shard (it needs a multiple of %d)",
                name or "the model", module.out_features, shard_world_size, block, module.recipe.name,
                block * shard_world_size,
            )
            continue
        module.weight = nn.Parameter(Float8AllGatherWeight(module.weight.data), requires_grad=module.weight.requires_grad)
    return model


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight (or FSDP2 shard of one) that FSDP2 all-gathers in FP8.

    It behaves as its plain tensor everywhere (the optimizer updates it in place); only
    FSDP2's all-gather hooks see the difference.
    """

    _tensor: torch.Tensor
    _precomputed_scale: torch.Tensor | None

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
        self._forward_scale: torch.Tensor | None = None  # the last forward gather's, for backward

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
        recipe = _active_recipe(module)
        shard = self._tensor
        param_dtype = getattr(mp_policy, "param_dtype", None) or shard.dtype
        shard = shard.to(param_dtype)
        group = mesh.get_group() if mesh is not None else None
        if isinstance(recipe, (TensorwiseScaling, DelayedScaling)):
            dtype = recipe.weight_dtype
            in_backward = torch._C._current_graph_task_id() != -1
            if in_backward and self._forward_scale is not None:
                # The re-gather for backward must reproduce the forward's weight (delayed
                # scales may have been updated since, at the autocast exit).
                scale = self._forward_scale
            elif isinstance(recipe, DelayedScaling):
                scale = module.fp8_scale[WEIGHT].detach().clone()
            elif self._precomputed_scale is not None:
                scale, self._precomputed_scale = self._precomputed_scale, None  # used once
            else:
                scale = _global_tensorwise_scales([shard], [recipe], group)[0]
            if not in_backward:
                self._forward_scale = scale
            qt = quantize(shard, "tensor", dtype=dtype, scale=scale)
            power_2 = isinstance(recipe, TensorwiseScaling) and recipe.power_2_scales
            # The shard's amax travels with the gathered weight: Float8Linear records it (for
            # delayed scaling) in a training forward; FSDP2 gathers under no_grad.
            shard_amax = shard.detach().abs().amax().to(torch.float32) if shard.numel() else None
            return (qt.data.view(torch.uint8),), ("tensor", dtype, qt.scale_inv, power_2, shard_amax)
        granularity = recipe.granularity("weight") if isinstance(recipe, BlockScaling) else "mx"
        block = recipe.block_size
        if shard.shape[0] % block:
            raise ValueError(
                f"FSDP2 shard of shape {tuple(shard.shape)} of {module} does not hold whole {block}-row blocks: "
                f"out_features={outer_size[0]} over {mesh.size()} ranks must give a multiple of {block} rows per rank"
            )
        rowwise = quantize(shard, granularity, dtype=recipe.weight_dtype, axis=-1)
        inputs = [rowwise.data.view(torch.uint8), _scale_bytes(rowwise.scale_inv)]
        if granularity != "block128x128":  # 1-D blocks: the columnwise copy is its own quantization
            columnwise = quantize(shard, granularity, dtype=recipe.weight_dtype, axis=0)
            inputs += [columnwise.data.view(torch.uint8), _scale_bytes(columnwise.scale_inv)]
        return tuple(inputs), (granularity, recipe.weight_dtype, None, True, None)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        granularity, fp8_dtype, scale_inv, power_2, shard_amax = metadata
        data = all_gather_outputs[0].view(fp8_dtype)
        if granularity == "tensor":
            rowwise = QuantizedTensor(data=data, scale_inv=scale_inv, granularity="tensor", power_2_scales=power_2)
            columnwise = None
        else:
            rowwise = QuantizedTensor(
                data=data, scale_inv=_scale_from_bytes(all_gather_outputs[1], granularity), granularity=granularity,
                axis=-1, power_2_scales=True,
            )
            columnwise = None
            if len(all_gather_outputs) == 4:
                columnwise = transpose(
                    QuantizedTensor(
                        data=all_gather_outputs[2].view(fp8_dtype),
                        scale_inv=_scale_from_bytes(all_gather_outputs[3], granularity),
                        granularity=granularity,
                        axis=0,
                        power_2_scales=True,
                    )
                )
        if out is not None:
            out._set_payload(rowwise, columnwise, shard_amax)
            return None
        return Float8GatheredWeight(rowwise, columnwise, param_dtype, shard_amax), tuple(all_gather_outputs)


def _scale_bytes(scale_inv: torch.Tensor) -> torch.Tensor:
    return scale_inv.contiguous().view(torch.uint8)


def _scale_from_bytes(raw: torch.Tensor, granularity: str) -> torch.Tensor:
    if granularity == "mx":
        return raw.view(torch.float8_e8m0fnu)
    return raw.view(torch.float32)


def _active_recipe(module: nn.Module) -> Recipe:
    from .autocast import current_state

    state = current_state()
    return state.recipe if state is not None and state.recipe is not None else module.recipe


def _global_tensorwise_scales(shards: list[torch.Tensor], recipes: list[TensorwiseScaling], group) -> list[torch.Tensor]:
    """Scales of whole weights from the MAX of their shards' amaxes: one all-reduce for all."""
    amaxes = torch.stack(
        [s.detach().abs().amax().to(torch.float32) if s.numel() else torch.zeros((), device=s.device) for s in shards]
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    return [
        amax_to_scale(
            amax, format_of(recipe.weight_dtype).max, power_2_scales=recipe.power_2_scales, amax_epsilon=recipe.amax_epsilon
        )
        for amax, recipe in zip(amaxes.unbind(), recipes)
    ]


def precompute_fp8_scales_for_fsdp(model: nn.Module, group=None) -> None:
    """After the optimizer step: compute the FP8 scale of every tensorwise weight from the
    MAX of its shards' amaxes in one batched all-reduce, for the next all-gather to use."""
    shards, recipes = [], []
    for module in model.modules():
        if isinstance(module, Float8Linear) and isinstance(_active_recipe(module), TensorwiseScaling):
            local = module.weight.to_local() if hasattr(module.weight, "to_local") else module.weight
            if isinstance(local, Float8AllGatherWeight):
                shards.append(local)
                recipes.append(_active_recipe(module))
    if not shards:
        return
    scales = _global_tensorwise_scales([shard._tensor for shard in shards], recipes, group)
    for shard, scale in zip(shards, scales):
        shard._precomputed_scale = scale


class Float8GatheredWeight(torch.Tensor):
    """The unsharded weight after an FP8 all-gather: FP8 payload, high-precision face.

    ``fp8_rowwise`` is the output GEMM's K-last operand; ``fp8_columnwise`` the grad_input
    GEMM's (``None`` where the transpose of ``fp8_rowwise`` serves). Ops other than
    aliasing and dtype moves see the dequantized weight.
    """

    @staticmethod
    def __new__(cls, rowwise, columnwise, dtype, shard_amax=None):
        data = rowwise.data
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(
        self,
        rowwise: QuantizedTensor,
        columnwise: QuantizedTensor | None,
        dtype: torch.dtype,
        shard_amax: torch.Tensor | None = None,
    ) -> None:
        self._set_payload(rowwise, columnwise, shard_amax)

    def _set_payload(self, rowwise, columnwise, shard_amax=None) -> None:
        self.fp8_rowwise, self.fp8_columnwise, self.fp8_shard_amax = rowwise, columnwise, shard_amax

    def __repr__(self) -> str:
        return f"Float8GatheredWeight({self.fp8_rowwise!r}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        payload = (weight.fp8_rowwise, weight.fp8_columnwise)
        if func in (aten.detach.default, aten.alias.default):
            return cls(*payload, weight.dtype, weight.fp8_shard_amax)
        if func is aten._to_copy.default and set(kwargs) <= {"dtype"}:
            return cls(*payload, kwargs.get("dtype", weight.dtype), weight.fp8_shard_amax)
        if func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(weight.shape):
            return cls(*payload, weight.dtype, weight.fp8_shard_amax)
        # Anything else (printing, a high-precision F.linear under autocast(enabled=False))
        # sees the dequantized weight.
        dequantized = tree_map_only(cls, lambda t: t.fp8_rowwise.dequantize(t.dtype), (args, kwargs))
        return func(*dequantized[0], **dequantized[1])
