"""Which weights of a ``Float8MultiheadAttention`` are stored in FP8 (``fp8_weights=True``,
``store_frozen_weights_in_fp8``), and how its packed in-projection serves cross-attention.

Its in-projection GEMMs take ``in_proj_weight`` ``[3E, E]`` (``q_proj_weight``,
``k_proj_weight`` and ``v_proj_weight`` where ``kdim`` or ``vdim`` differ from ``E``:
each stored on its own); ``out_proj`` is a ``Float8Linear`` with its own weight.

Self-attention (``query is key is value``) runs one GEMM on the whole packed weight: it
takes the stored operands. Cross-attention runs a GEMM on each slice (``[E, E]`` for ``q``,
``[2E, E]`` for ``k, v`` where ``key is value``, else ``[E, E]`` each), quantized on its own
(its own scales), which no slice of the whole weight's operands equals. There a trainable
weight's slices are taken from its master (the optimizer's, or the value pending for it),
the value the same module holds in high precision, so the results are the same bit for
bit, at the cost of quantizing the slices at each step, as without ``fp8_weights``. A
frozen weight stored in FP8 only has no such value: cross-attention on it is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from .float8_weight import OPTIMIZER_HINT, Float8Weight
from .module_weights import is_frozen_parameter

__all__ = ["in_projection_left_reason", "in_projection_weight_types", "sliceable_in_proj_weight"]

def in_projection_left_reason(attention: nn.Module) -> str | None:
    """Why ``attention``'s in-projection weights stay in high precision (``None``: they are
    stored). Under delayed scaling the module's one state rescales the weight from a
    history of its GEMMs; a weight quantized once with the next forward's scale follows it
    only where one stored weight runs one GEMM per forward and trains."""
    if not attention.recipe.operand_plan.delayed:
        return None
    if not attention._qkv_same_embed_dim:
        return "delayed scaling: the q, k and v GEMMs of one forward update their shared weight scale between them"
    if is_frozen_parameter(attention.in_proj_weight):
        return "frozen under delayed scaling: its weight scale follows a history, which a weight quantized once cannot"
    return None


def in_projection_weight_types(attention: nn.Module) -> dict[str, type[Float8Weight]]:
    """``{name: Float8Weight}`` of ``attention``'s in-projection weights that it can store in
    FP8 (``{}`` where :func:`in_projection_left_reason` gives a reason)."""
    if in_projection_left_reason(attention) is not None:
        return {}
    if attention._qkv_same_embed_dim:
        return {"in_proj_weight": Float8Weight}
    return dict.fromkeys(("q_proj_weight", "k_proj_weight", "v_proj_weight"), Float8Weight)


class _MasterValue(torch.autograd.Function):
    """A trainable FP8 weight's master value (in its dtype), whose gradient goes to the weight."""

    @staticmethod
    def forward(ctx, weight: Float8Weight) -> torch.Tensor:
        return weight.checkpoint_value()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def sliceable_in_proj_weight(weight: torch.Tensor) -> torch.Tensor:
    """``in_proj_weight`` as cross-attention slices it: itself in high precision; of one
    stored in FP8, its master's value (module docstring).

    Raises:
        ValueError: the weight is stored in FP8 only (frozen), or trains while no optimizer
            holds its master (as for any trainable FP8 weight).
    """
    if not isinstance(weight, Float8Weight):
        return weight
    master = weight.fp8_master
    if master is None or (master.master is None and master.pending is None):
        raise ValueError(
            "in_proj_weight is stored in FP8 as one packed [3 * embed_dim, embed_dim] weight, which serves "
            "self-attention (query is key is value); cross-attention quantizes each of its slices on its own, from "
            "the high-precision weight, which a weight stored in FP8 only does not keep: leave this attention's "
            "weights in high precision (fp8train.restore_high_precision_weights(attention) gives them back, "
            "dequantized), or run it as self-attention"
        )
    if torch.is_grad_enabled() and weight.requires_grad and master.master is None:
        raise ValueError(
            f"in_proj_weight is stored in FP8 and trains, but no optimizer holds its master weight: {OPTIMIZER_HINT}"
        )
    return _MasterValue.apply(weight)
