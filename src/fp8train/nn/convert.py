"""Swap ``nn.Linear`` modules for :class:`~fp8train.nn.linear.Float8Linear` and back."""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import torch
from torch import nn

from ..quant.gemm import BACKENDS
from ..spec.checks import check_bool, check_callable, check_choice, check_int, check_type
from ..spec.recipes import Recipe, resolve_recipe
from .linear import Float8Linear

__all__ = [
    "convert_to_float8_training",
    "convert_to_linear",
    "drop_fp8_state",
    "FP8_STATE_NAMES",
    "linear_layers",
    "alignment_skip_reason",
]

FP8_STATE_NAMES = ("fp8_scale", "fp8_amax_history")
"""Buffer names of delayed scaling's state in a converted model's ``state_dict``."""

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> nn.Module:
    if not fqn:
        return new
    parent_name, _, child_name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name, new)
    return model


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """``(qualified name, module)`` of every layer :func:`convert_to_float8_training`
    considers (``nn.Linear`` itself, not subclasses that may override ``forward``) or has
    converted (``Float8Linear``), in ``named_modules`` order."""
    return [(fqn, m) for fqn, m in model.named_modules() if type(m) is nn.Linear or isinstance(m, Float8Linear)]


def alignment_skip_reason(module: nn.Linear, dim_alignment: int) -> str | None:
    """Why ``module`` stays in high precision under ``dim_alignment`` (``None``: it converts)."""
    if dim_alignment and (module.in_features % dim_alignment or module.out_features % dim_alignment):
        return (
            f"in_features={module.in_features}, out_features={module.out_features} are not both "
            f"multiples of {dim_alignment}"
        )
    return None


def convert_to_float8_training(
    model: nn.Module,
    recipe: Recipe | str = "tensorwise",
    *,
    module_filter_fn: ModuleFilter | None = None,
    dim_alignment: int | None = None,
    backend: str = "auto",
    save_fp8_activations: bool = True,
) -> nn.Module:
    """Swap every eligible ``nn.Linear`` of ``model`` for a ``Float8Linear``, in place.

    Parameters are shared, not copied, so an optimizer built afterwards sees the same
    tensors; convert after moving the model to its device and before ``torch.compile``
    and the optimizer. A layer is skipped (and the skip logged) when ``module_filter_fn``
    rejects it or when ``in_features`` or ``out_features`` is not a multiple of the
    alignment. A summary such as ``FP8 training (tensorwise): converted 42/44 Linear
    layers`` is logged at INFO.

    Args:
        model: any module; may itself be an ``nn.Linear``.
        recipe: a :class:`~fp8train.spec.recipes.Recipe` or a recipe name.
        module_filter_fn: ``(module, fqn) -> bool``; ``False`` keeps the layer in high
            precision (e.g. ``lambda m, fqn: fqn != "lm_head"``).
        dim_alignment: the multiple both dims must meet; ``None`` takes the recipe's (16,
            128 for blockwise, 32 for MXFP8); ``0`` turns the check off.
        backend: GEMM backend of the new modules (``"auto"``, ``"emulated"``, ``"hardware"``).
        save_fp8_activations: the new modules keep their inputs for the backward in FP8
            where the grad_weight GEMM runs in FP8 (``False``: in high precision); see
            :class:`~fp8train.nn.linear.Float8Linear`.

    Returns:
        ``model`` (or the new module, if ``model`` itself was an ``nn.Linear``).

    Raises:
        ValueError: bad recipe name, negative ``dim_alignment`` or unknown backend.
        TypeError: ``model`` is not an ``nn.Module``, ``recipe`` neither a Recipe nor a
            name, ``module_filter_fn`` not callable, ``dim_alignment`` not an int,
            ``save_fp8_activations`` not a bool.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    recipe = resolve_recipe(recipe)
    check_callable("module_filter_fn", module_filter_fn, allow_none=True, signature="(module, fqn) -> bool")
    check_choice("backend", backend, BACKENDS)
    check_bool("save_fp8_activations", save_fp8_activations)
    if dim_alignment is None:
        dim_alignment = recipe.alignment
    check_int("dim_alignment", dim_alignment, minimum=0)
    linears = [(fqn, m) for fqn, m in linear_layers(model) if type(m) is nn.Linear]
    converted = 0
    for fqn, module in linears:
        name = fqn or "<root>"
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            logger.info("FP8 training: skipping %s (excluded by module_filter_fn)", name)
            continue
        reason = alignment_skip_reason(module, dim_alignment)
        if reason is not None:
            logger.info("FP8 training: skipping %s: %s", name, reason)
            continue
        new = Float8Linear.from_linear(
            module, recipe=recipe, backend=backend, save_fp8_activations=save_fp8_activations
        )
        model = _replace(model, fqn, new)
        converted += 1
    logger.info("FP8 training (%s): converted %d/%d Linear layers", recipe.name, converted, len(linears))
    return model


def convert_to_linear(model: nn.Module) -> nn.Module:
    """Swap every ``Float8Linear`` back to a plain ``nn.Linear`` with the same parameters.

    FP8 state (delayed scaling's ``fp8_scale`` and ``fp8_amax_history``) is dropped.

    Returns:
        ``model`` (or the new module, if ``model`` itself was a ``Float8Linear``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    check_type("model", model, nn.Module, "an nn.Module")
    for fqn, module in [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]:
        with torch.device("meta"):
            linear = nn.Linear(module.in_features, module.out_features, bias=False)
        linear.weight = module.weight
        linear.bias = module.bias
        model = _replace(model, fqn, linear)
    return model


def drop_fp8_state(state_dict: dict) -> dict:
    """A copy of ``state_dict`` without delayed scaling's FP8 state, for loading a converted
    model's checkpoint strictly into a plain model.

    Raises:
        TypeError: ``state_dict`` is not a mapping.
    """
    check_type("state_dict", state_dict, Mapping, "a mapping of names to tensors (a state_dict)")
    return {key: value for key, value in state_dict.items() if key.rpartition(".")[2] not in FP8_STATE_NAMES}
