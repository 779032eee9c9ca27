"""How a weight stored in FP8 follows delayed scaling's weight scale, which the module's
state (:mod:`fp8train.nn.delayed.state`) moves at each step:

* a frozen weight (stored once, or kept in high precision) takes the scale of its own amax
  at each forward (:func:`rescale_frozen_weight`), as its history would give it while it
  is unchanged, so a PEFT merge or unmerge never runs on a stale scale;
* a trainable one is re-quantized from its master where the scale a forward uses is not
  the one it was last quantized with (:func:`follow_delayed_weight_scales`: gradient
  accumulation, a module run twice).
"""

from __future__ import annotations

import torch

from ...spec.roles import Role
from ..delayed.amax import tensor_amax
from ..delayed.state import DelayedScalingState, update_delayed_tensors
from .float8_weight import Float8Weight

__all__ = ["rescale_frozen_weight", "follow_delayed_weight_scales"]

_WEIGHT_COLUMN = slice(Role.WEIGHT.index, Role.WEIGHT.index + 1)


def rescale_frozen_weight(state: DelayedScalingState, weight: torch.Tensor) -> None:
    """Set delayed scaling's weight column from ``weight``'s own amax: every history row
    holds it (row 0 again once the forward records it) and the scale is the recipe's for it.

    A frozen weight changes only outside training (a PEFT ``merge_adapter``,
    ``unmerge_adapter`` or ``merge_and_unload``; a load), where a history would leave the
    scale of the weight it replaced; while it is unchanged this gives the scale its history
    would, from the first step on. Of a :class:`Float8Weight`, the amax of the
    high-precision weight it was quantized from.
    """
    with torch.no_grad():
        history = state.amax_history
        amax = weight.fp8_shard_amax if isinstance(weight, Float8Weight) else tensor_amax(weight)
        history[..., _WEIGHT_COLUMN] = amax
        update_delayed_tensors(history, state.scale, state.recipe, _WEIGHT_COLUMN)


def follow_delayed_weight_scales(module: torch.nn.Module) -> None:
    """At a forward of ``module`` under delayed scaling, once its state is up to date:
    re-quantize each trainable FP8 weight of it from its master where the weight scale this
    forward uses is not the one it was last quantized with, as a high-precision weight is
    quantized with each forward's scale. They differ where several forwards update the scale
    between two optimizer steps (gradient accumulation; a module run more than once outside
    ``fp8train.autocast``). One comparison of a scale a forward (on a GPU, a sync). The
    caller (:meth:`~fp8train.nn.modules.base.Float8Module._delayed_tensors`) calls it
    neither in a recompute (activation checkpointing), which uses what its forward used,
    nor while compiling (stored weights run eagerly)."""
    parameters = module._parameters  # the module's own: parameters(recurse=False), without a call
    for name in parameters:
        weight = parameters[name]
        # (a plain parameter, or none: no call, issue 38)
        if type(weight) is torch.nn.Parameter or weight is None or not hasattr(weight, "weight_scale_of"):
            continue
        link = getattr(weight, "fp8_master", None)
        if link is None or link.delayed_state is None or link.master is None:
            continue
        scale = weight.weight_scale_of(link.delayed_state.scale).detach()
        if link.quantized_scale is None or not torch.equal(scale, link.quantized_scale):
            link.quantized_scale = scale.clone()
            weight.requantize_(link.master, link.quantized_scale)
