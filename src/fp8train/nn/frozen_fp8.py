"""Store a model's frozen FP8 weights in FP8 only, and give them back their high precision.

Why a call, after freezing, rather than an option of ``convert_to_float8_training``: which
weights are frozen is decided after conversion as often as before (``peft.get_peft_model``
on a converted model freezes its base layers; a backbone frozen for a fine-tune), and a
weight stored in FP8 only cannot train, so the switch follows the freezing, explicitly.
A lazy switch at a frozen weight's first forward was the other candidate: it would change
the model's parameters (and memory) in the middle of a step, behind the user's back.
"""

from __future__ import annotations

import logging

from torch import nn

from ..spec.checks import check_type
from .fp8_weight import Float8Weight, tied_parameter_ids
from .frozen_weight import is_frozen_parameter, restore_weight_precision, store_weight_in_fp8
from .primary_weight import log_stored, storable_weights

__all__ = ["store_frozen_weights_in_fp8", "restore_high_precision_weights"]

logger = logging.getLogger(__name__)


def store_frozen_weights_in_fp8(model: nn.Module) -> list[str]:
    """Hold every weight of ``model``'s converted modules that does not train
    (``requires_grad=False``: PEFT's base layers, a frozen backbone) in FP8 only, in the
    operands its recipe needs (:class:`~fp8train.nn.fp8_weight.Float8Weight`: one copy for
    ``tensorwise``, ``delayed``, ``blockwise`` and ``nvfp4``, two for ``rowwise``,
    ``rowwise_with_gw_hp``, ``mxfp8`` and ``mxfp4``), and free its high-precision tensor.
    The weights are those each module's ``fp8_weight_types()`` names: ``Float8Linear``'s,
    ``Float8Conv1D``'s (``[in, out]``), ``Float8MultiheadAttention``'s in-projection (its
    ``out_proj`` is a ``Float8Linear``), ``Float8Experts``' 3-D weights (per expert).

    Call it after freezing (after ``peft.get_peft_model``) and conversion, and before
    building the optimizer (an optimizer given the frozen parameters would keep them
    alive). Forward and grad_input are those of the same model with its high-precision
    weights, bit for bit (the forward quantizes them the same way; outside
    ``torch.autocast``, or with weights already in its dtype). ``state_dict`` holds the
    dequantized weights; loading one re-quantizes them. Left in high precision (logged):
    weights that train, sharded ones, weights tied to another module's (an ``lm_head`` tied
    to the embedding), and under delayed scaling the in-projection of a
    ``Float8MultiheadAttention`` and the weights of ``Float8Experts`` (their weight scales
    follow a history, not one frozen weight's amax, which a weight stored once cannot).

    Returns:
        The qualified names of the modules whose weights are stored in FP8 (including those
        already stored so).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    shared = tied_parameter_ids(model)
    stored, left = [], []
    for fqn, module, name, where in storable_weights(model, is_frozen_parameter, left):
        weight = getattr(module, name)
        if not is_frozen_parameter(weight):
            continue
        if id(weight) in shared:
            left.append(f"{where} (tied)")
            continue
        store_weight_in_fp8(module, name)
        stored.append(fqn)
    return log_stored(logger, stored, left, "frozen weights stored in FP8 only", "frozen weights left in high precision")


def restore_high_precision_weights(model: nn.Module) -> list[str]:
    """Undo :func:`store_frozen_weights_in_fp8`: every weight stored in FP8 only becomes a
    plain frozen parameter holding its dequantized values (what a PEFT ``merge_and_unload``,
    an unfreezing or an in-place change needs). Lossy once: those values are the FP8 ones.

    Returns:
        The qualified names of the modules restored.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    restored = []
    for fqn, module in model.named_modules():
        names = [name for name, param in module._parameters.items() if isinstance(param, Float8Weight)]
        for name in names:
            restore_weight_precision(module, name)
        if names:
            restored.append(fqn)
    return restored
