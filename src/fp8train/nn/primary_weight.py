"""FP8 primary weights: trainable weights held only quantized between steps
(``convert_to_float8_training(..., fp8_weights=True)``).

Each eligible ``Float8Linear``'s weight becomes a trainable
:class:`~fp8train.nn.fp8_weight.Float8Weight` (the operands its recipe's plan needs; one
copy where the granularity is symmetric), whose forward and backward use the stored
operands without a per-step cast. Its master lives in the optimizer: ``fp8train.optim.AdamW``
takes the high-precision weight kept pending at conversion
(:class:`~fp8train.nn.weight_master.WeightMaster`), updates it with the high-precision
gradient and re-quantizes the module's weight after each step. Left in high precision
(logged): frozen weights (``store_frozen_weights_in_fp8`` is theirs), tied weights, weights
already sharded or wrapped (a DTensor, FSDP2's FP8 all-gather), and the weights of
``Float8Conv1D``, ``Float8MultiheadAttention`` and ``Float8Experts``.
"""

from __future__ import annotations

import logging

from torch import nn

from .fp8_weight import Float8Weight, tied_parameter_ids
from .linear import Float8Linear, Float8Module
from .weight_master import WeightMaster

__all__ = ["store_trainable_weights_in_fp8"]

logger = logging.getLogger(__name__)


def _store(module: Float8Linear) -> None:
    """Replace ``module``'s trainable weight by a trainable :class:`Float8Weight` quantized
    as its next forward would quantize it, the high-precision tensor pending for the optimizer."""
    weight_hp = module.weight.detach()
    master = WeightMaster(weight_hp, module.delayed_state)
    stored = Float8Weight.quantize(weight_hp, module.recipe.operand_plan, master.scale(), master=master)
    module.weight = nn.Parameter(stored, requires_grad=True)
    master.attach(module.weight)


def _reason_left(module: nn.Module, weight, shared: set[int]) -> str | None:
    """Why ``module`` (a ``Float8Module``) keeps its weight in high precision (``None``: it does not)."""
    if isinstance(weight, Float8Weight):
        return None if weight.requires_grad else "frozen, stored in FP8 already"
    if not isinstance(module, Float8Linear):
        return type(module).__name__
    if not weight.requires_grad:
        return "frozen: fp8train.store_frozen_weights_in_fp8 stores it"
    if type(weight) is not nn.Parameter:
        return f"a {type(weight).__name__} (sharded or wrapped)"
    if id(weight) in shared:
        return "tied"
    return None


def store_trainable_weights_in_fp8(model: nn.Module) -> list[str]:
    """Hold the trainable weight of every converted ``Float8Linear`` of ``model`` in FP8
    only (see the module docstring). Call right after conversion, before building the
    optimizer (``fp8train.optim.AdamW``, which takes the masters).

    Returns:
        The qualified names of the modules whose weight is a trainable FP8 weight.
    """
    shared = tied_parameter_ids(model)
    stored, left = [], []
    for fqn, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, Float8Module) or weight is None:
            continue
        reason = _reason_left(module, weight, shared)
        if reason is not None:
            left.append(f"{fqn or '<root>'} ({reason})")
            continue
        if not isinstance(weight, Float8Weight):
            _store(module)
        stored.append(fqn)
    logger.info("fp8train: %d trainable weights stored in FP8 (fp8_weights=True)", len(stored))
    if left:
        logger.info("fp8train: weights left in high precision under fp8_weights=True: %s", ", ".join(left))
    return stored
