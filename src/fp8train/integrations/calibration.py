"""Calibrate the activation scales a W4A4 checkpoint needs: the largest ``|input|`` each
Linear sees on a few batches (:func:`calibrate_input_amax`), the ``input_amax`` of
:func:`fp8train.save_pretrained_quantized` for ``"nvfp4"`` and ``"nvfp4_modelopt"``.

Why a calibration and not training's own numbers: the ``nvfp4`` recipe scales each
activation by its own amax, step by step (current scaling), so training keeps no amax to
hand over; and the activations inference meets are those of the final weights, which a
calibration of the trained model measures (an amax recorded over training would also hold
the early steps' activations, of a different model). The model is run as it is: converted
to FP8 or 4 bits, each Linear sees the activations its quantized predecessors give, as the
inference engine's quantized layers will.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch
from torch import nn

from ..spec.checks import ArgumentTypeError, check_callable, check_type
from .checkpoint_formats import CheckpointFormat
from .fused_layers import fused_amax

__all__ = ["calibrate_input_amax", "input_scale_tensors"]

Forward = Callable[[nn.Module, Any], Any]


def calibrate_input_amax(
    model: nn.Module, batches: Iterable[Any], *, forward: Forward | None = None
) -> dict[str, float]:
    """The largest ``|input|`` each ``nn.Linear`` of ``model`` (a converted
    :class:`~fp8train.Float8Linear` too) sees over ``batches``, by qualified name: the
    ``input_amax`` that makes :func:`~fp8train.save_pretrained_quantized` write W4A4 NVFP4.

    The model runs each batch in evaluation mode (dropout off, as inference runs it) under
    ``torch.no_grad()``; every module's training mode is restored after, and nothing else
    changes. A few batches of the data the model will serve are enough: the amax sets the
    activation's global scale only, each 1x16 block keeps its own scale.

    Args:
        model: any ``nn.Module``, converted to FP8 training or not.
        batches: an iterable of batches (at least one).
        forward: ``(model, batch) -> anything``, how to run one batch. Default: a mapping is
            passed as keyword arguments (``model(**batch)``, e.g. a tokenizer's output), a
            tuple or list as positional ones, anything else as the one argument.

    Returns:
        ``{linear name: amax}`` for every Linear the batches reach, in module order. A Linear
        the forward never calls is absent (``save_pretrained_quantized`` names it).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``forward`` is not callable.
        ValueError: ``batches`` is empty; the model has no Linear; an input held a NaN or an
            infinity (naming the Linears).
    """
    check_type("model", model, nn.Module, "an nn.Module")
    check_callable("forward", forward, allow_none=True, signature="(model, batch) -> anything")
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear to calibrate")
    amax: dict[str, torch.Tensor] = {}
    handles = [module.register_forward_pre_hook(_recorder(name, amax), with_kwargs=True) for name, module in linears]
    modes = {module: module.training for module in model.modules()}
    run = _default_forward if forward is None else forward
    count = 0
    try:
        model.eval()
        with torch.no_grad():
            for batch in batches:
                run(model, batch)
                count += 1
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    if count == 0:
        raise ValueError("batches is empty; calibrate on at least one batch of the data the model will serve")
    found = {name: float(amax[name]) for name, _ in linears if name in amax}  # one host sync per Linear
    not_finite = {name: value for name, value in found.items() if not math.isfinite(value)}
    if not_finite:
        raise ValueError(
            f"calibration inputs held a NaN or an infinity at {not_finite}; calibrate on batches the model "
            "runs finitely (fp8train.detect_nonfinite finds where a non-finite value starts)"
        )
    return found


def _recorder(name: str, amax: dict[str, torch.Tensor]):
    """A forward pre-hook that folds its Linear's input amax into ``amax[name]``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return
        seen = x.detach().abs().amax().float()
        previous = amax.get(name)
        amax[name] = seen if previous is None else torch.maximum(previous, seen)  # NaN propagates

    return hook


def _default_forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def input_scale_tensors(
    input_amax: Mapping[str, float | torch.Tensor], names: list[str], fmt: CheckpointFormat
) -> dict[str, torch.Tensor]:
    """Each quantized Linear's input tensors in ``fmt`` (``input_global_scale``,
    ``input_scale``) from its calibrated amax, shared (the largest) across a group vLLM fuses.

    Raises:
        TypeError: ``input_amax`` is not a mapping.
        ValueError: a Linear in ``names`` lacks an amax, or one is not positive and finite.
    """
    if not isinstance(input_amax, Mapping):
        raise ArgumentTypeError(
            f"input_amax must be a mapping of Linear names to amax, got {type(input_amax).__name__}"
        )
    missing = [name for name in names if name not in input_amax]
    if missing:
        raise ValueError(
            f"input_amax has no amax for the Linears written quantized {missing}; calibrate every one "
            "(fp8train.calibrate_input_amax records those its batches' forward reaches)"
        )
    amax = {name: torch.as_tensor(input_amax[name], dtype=torch.float32).detach().cpu().reshape(()) for name in names}
    bad = {name: float(value) for name, value in amax.items() if not (math.isfinite(value) and value > 0)}
    if bad:
        raise ValueError(f"input_amax must be positive and finite, got {bad}")
    amax.update(fused_amax(amax))
    return {f"{name}.{suffix}": tensor for name in names for suffix, tensor in fmt.input_tensors(amax[name]).items()}
