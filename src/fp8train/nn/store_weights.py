"""The model walks that store a converted model's weights in FP8, and give them back their
high precision: one walk over the weights each converted module can hold in FP8 (its
``fp8_weight_types()``: ``Float8Linear``'s ``weight``; ``Float8Conv1D``'s ``[in, out]``
``weight``, as a :class:`~fp8train.nn.weights.transposed.TransposedFloat8Weight`;
``Float8MultiheadAttention``'s ``in_proj_weight``, or ``q_proj_weight``, ``k_proj_weight``
and ``v_proj_weight``, its ``out_proj`` being a ``Float8Linear``; ``Float8Experts``'
``gate_up_proj`` and ``down_proj``, one ``Float8Weight`` per expert, as a
:class:`~fp8train.nn.weights.experts.Float8ExpertWeights`), for two uses. What one module
does with one of its weights (store, restore, its ``state_dict``) is
:mod:`fp8train.nn.weights.module_weights`.

FP8 primary weights (``convert_to_float8_training(..., fp8_weights=True)``,
:func:`store_trainable_weights_in_fp8`): each eligible trainable weight becomes a trainable
:class:`~fp8train.nn.weights.float8_weight.Float8Weight` (the operands its recipe's plan
needs; one copy where the granularity is symmetric), whose forward and backward use the
stored operands without a per-step cast. Its master lives in the optimizer:
``fp8train.optim.AdamW`` takes the high-precision weight kept pending at conversion
(:class:`~fp8train.nn.weights.master.WeightMaster`), updates it with the high-precision
gradient and re-quantizes the module's weight after each step. Left in high precision
(logged): frozen weights (``store_frozen_weights_in_fp8`` is theirs), tied weights, weights
already sharded or wrapped (a DTensor, FSDP2's FP8 all-gather), and those a module's
``fp8_weights_left_reason`` names (an attention's separate q, k, v weights under delayed scaling).

Frozen weights stored in FP8 only (:func:`store_frozen_weights_in_fp8`, undone by
:func:`restore_high_precision_weights`). Why a call, after freezing, rather than an option of
``convert_to_float8_training``: which weights are frozen is decided after conversion as
often as before (``peft.get_peft_model`` on a converted model freezes its base layers; a
backbone frozen for a fine-tune), and a weight stored in FP8 only cannot train, so the
switch follows the freezing, explicitly. A lazy switch at a frozen weight's first forward
was the other candidate: it would change the model's parameters (and memory) in the middle
of a step, behind the user's back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from torch import nn

from ..spec.checks import check_type
from .modules.base import Float8Module
from .weights.float8_weight import Float8Weight
from .weights.master import WeightMaster
from .weights.module_weights import is_frozen_parameter, restore_weight_precision, store_weight_in_fp8

__all__ = ["store_trainable_weights_in_fp8", "store_frozen_weights_in_fp8", "restore_high_precision_weights"]

logger = logging.getLogger(__name__)


def tied_parameter_ids(model: nn.Module) -> set[int]:
    """Ids of ``model``'s parameters held under more than one name (tied weights), which
    stay in high precision: storing one name's weight in FP8 would change the other's."""
    seen, shared = set(), set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (shared if id(param) in seen else seen).add(id(param))
    return shared


def weight_label(fqn: str, name: str) -> str:
    """How a log names ``module.name`` (``fqn`` the module's): the module's name for its
    ``weight``, else ``fqn.name`` (an attention's ``in_proj_weight``)."""
    if name == "weight":
        return fqn or "<root>"
    return f"{fqn}.{name}" if fqn else name


def storable_weights(model: nn.Module, wanted, left: list[str]) -> Iterator[tuple[str, Float8Module, str, str]]:
    """``(module name, module, parameter name, label)`` of each weight that ``model``'s
    converted modules can hold in FP8 (``Float8Module.fp8_weight_types()``). A module that
    can hold none but has a parameter ``wanted(parameter)`` selects is added to ``left``,
    with the module's reason."""
    for fqn, module in model.named_modules():
        if not isinstance(module, Float8Module):
            continue
        names = module.fp8_weight_types()
        if not names and any(wanted(p) for p in module.parameters(recurse=False)):
            left.append(f"{fqn or '<root>'} ({type(module).__name__}: {module.fp8_weights_left_reason})")
        for name in names:
            yield fqn, module, name, weight_label(fqn, name)


def log_stored(stored: list[str], left: list[str], stored_what: str, left_what: str) -> list[str]:
    """Log how many weights were stored and which were left (with why); the stored modules'
    names, each once."""
    logger.info("fp8train: %d %s", len(stored), stored_what)
    if left:
        logger.info("fp8train: %s: %s", left_what, ", ".join(left))
    return list(dict.fromkeys(stored))


def _store(module: Float8Module, name: str) -> None:
    """Replace ``module``'s trainable weight ``name`` by a trainable :class:`Float8Weight` (of
    the class ``module.fp8_weight_types()`` names) quantized as its next forward would
    quantize it, the high-precision tensor pending for the optimizer."""
    weight_hp = getattr(module, name).detach()
    master = WeightMaster(weight_hp, module.delayed_state)
    stored_type = module.fp8_weight_types()[name]
    # One module-wide weight scale only where the delayed state has no leading dims (experts'
    # weights take theirs per expert from the master's state).
    scale = master.scale() if module._delayed_state_shape == () else None
    stored = stored_type.quantize(weight_hp, module.recipe.operand_plan, scale, master=master)
    setattr(module, name, nn.Parameter(stored, requires_grad=True))
    master.attach(getattr(module, name), module, name)


def _reason_left(weight, shared: set[int]) -> str | None:
    """Why a weight a module could store in FP8 stays in high precision (``None``: it does not)."""
    if isinstance(weight, Float8Weight):
        return None if weight.requires_grad else "frozen, stored in FP8 already"
    if not weight.requires_grad:
        return "frozen: fp8train.store_frozen_weights_in_fp8 stores it"
    if type(weight) is not nn.Parameter:
        return f"a {type(weight).__name__} (sharded or wrapped)"
    if id(weight) in shared:
        return "tied"
    return None


def store_trainable_weights_in_fp8(model: nn.Module) -> list[str]:
    """Hold every trainable weight of ``model``'s converted modules that they can store in
    FP8 only (see the module docstring). Call right after conversion, before building the
    optimizer (``fp8train.optim.AdamW``, which takes the masters).

    Returns:
        The qualified names of the modules whose weights are trainable FP8 weights.
    """
    shared = tied_parameter_ids(model)
    stored, left = [], []
    for fqn, module, name, where in storable_weights(model, lambda p: p.requires_grad, left):
        reason = _reason_left(getattr(module, name), shared)
        if reason is not None:
            left.append(f"{where} ({reason})")
            continue
        if not isinstance(getattr(module, name), Float8Weight):
            _store(module, name)
        stored.append(fqn)
    return log_stored(
        stored, left, "trainable weights stored in FP8 (fp8_weights=True)",
        "weights left in high precision under fp8_weights=True",
    )  # fmt: skip


def store_frozen_weights_in_fp8(model: nn.Module) -> list[str]:
    """Hold every weight of ``model``'s converted modules that does not train
    (``requires_grad=False``: PEFT's base layers, a frozen backbone) in FP8 only, in the
    operands its recipe needs (:class:`~fp8train.nn.weights.float8_weight.Float8Weight`: one copy for
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
    return log_stored(stored, left, "frozen weights stored in FP8 only", "frozen weights left in high precision")


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
