"""FP8 primary weights: trainable weights held only quantized between steps
(``convert_to_float8_training(..., fp8_weights=True)``).

Each eligible weight of a converted module (those its ``fp8_weight_types()`` names:
``Float8Linear``'s ``weight``; ``Float8Conv1D``'s ``[in, out]`` ``weight``, as a
:class:`~fp8train.nn.transposed_fp8_weight.TransposedFloat8Weight`;
``Float8MultiheadAttention``'s ``in_proj_weight``, or ``q_proj_weight``, ``k_proj_weight``
and ``v_proj_weight``, its ``out_proj`` being a ``Float8Linear``; ``Float8Experts``'
``gate_up_proj`` and ``down_proj``, one ``Float8Weight`` per expert, as a
:class:`~fp8train.nn.expert_fp8_weights.Float8ExpertWeights`) becomes a trainable
:class:`~fp8train.nn.fp8_weight.Float8Weight` (the operands its recipe's plan needs; one
copy where the granularity is symmetric), whose forward and backward use the stored
operands without a per-step cast. Its master lives in the optimizer: ``fp8train.optim.AdamW``
takes the high-precision weight kept pending at conversion
(:class:`~fp8train.nn.weight_master.WeightMaster`), updates it with the high-precision
gradient and re-quantizes the module's weight after each step. Left in high precision
(logged): frozen weights (``store_frozen_weights_in_fp8`` is theirs), tied weights, weights
already sharded or wrapped (a DTensor, FSDP2's FP8 all-gather), and those a module's
``fp8_weights_left_reason`` names (an attention's separate q, k, v weights under delayed scaling).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from torch import nn

from .fp8_weight import Float8Weight, tied_parameter_ids
from .linear import Float8Module
from .weight_master import WeightMaster

__all__ = ["store_trainable_weights_in_fp8", "weight_label", "storable_weights", "log_stored"]

logger = logging.getLogger(__name__)


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


def log_stored(
    log: logging.Logger, stored: list[str], left: list[str], stored_what: str, left_what: str
) -> list[str]:
    """Log on ``log`` how many weights were stored and which were left (with why); the
    stored modules' names, each once."""
    log.info("fp8train: %d %s", len(stored), stored_what)
    if left:
        log.info("fp8train: %s: %s", left_what, ", ".join(left))
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
        logger, stored, left, "trainable weights stored in FP8 (fp8_weights=True)",
        "weights left in high precision under fp8_weights=True",
    )  # fmt: skip
