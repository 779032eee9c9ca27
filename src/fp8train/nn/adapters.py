"""PEFT's adapter modules in a model, found without importing peft.

A PEFT tuner layer (peft's ``BaseTunerLayer``: LoRA's ``lora.Linear``, IA3's, LoHa's, ...)
wraps a ``base_layer`` and holds its adapters in the containers its class names in
``adapter_layer_names`` (LoRA: ``lora_A``, ``lora_B``, ``lora_embedding_A``,
``lora_embedding_B``, ``lora_magnitude_vector``). :func:`fp8train.convert_to_float8_training`
converts the base layer and leaves the adapters in high precision: they are small (a GEMM
of rank 8 or 16 gains nothing in FP8, and most such shapes do not meet FP8's alignment)
and they are the part that trains.

peft is looked up in ``sys.modules``: a model that holds PEFT layers was built by peft,
which is then imported; fp8train never imports it.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["TUNER_LAYER_CLASS", "adapter_containers"]

TUNER_LAYER_CLASS = ("peft.tuners.tuners_utils", "BaseTunerLayer")
"""``(module, name)`` of peft's base class of every tuner layer."""


def _tuner_layer_class() -> type | None:
    module_name, class_name = TUNER_LAYER_CLASS
    peft_tuners = sys.modules.get(module_name)
    return getattr(peft_tuners, class_name, None) if peft_tuners is not None else None


def adapter_containers(model: nn.Module) -> dict[str, str]:
    """The adapter containers of every PEFT tuner layer in ``model``.

    Returns:
        ``{qualified name prefix: description}``: the prefix (``"...q_proj.lora_A."``)
        begins the name of every module inside one container; the description names the
        tuner layer's class and the container (``"Linear.lora_A"``). Empty where peft is
        not imported or ``model`` holds no tuner layer.
    """
    tuner_layer = _tuner_layer_class()
    if tuner_layer is None:
        return {}
    containers = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, tuner_layer):
            continue
        for name in module.adapter_layer_names:
            if isinstance(getattr(module, name, None), nn.Module):
                prefix = f"{fqn}.{name}." if fqn else f"{name}."
                containers[prefix] = f"{type(module).__name__}.{name}"
    return containers
