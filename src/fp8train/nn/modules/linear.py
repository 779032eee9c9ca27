"""``Float8Linear``: an ``nn.Linear`` whose three GEMMs run in FP8 per a recipe.

The module owns the parameters; what every FP8 module holds (the recipe, delayed scaling's
state, ``run_linear``) is its base :class:`~fp8train.nn.modules.base.Float8Module`, and the
arithmetic of the three GEMMs is :class:`~fp8train.nn.function.Float8LinearFunction`,
driven by the recipe's operand plan.
"""

from __future__ import annotations

import torch
from torch import nn

from ...quant.quantize import PLAIN_TENSOR_TYPES
from ...spec.checks import check_bool, check_int, check_type
from ...spec.recipes import Recipe
from ..config import Float8ModuleConfig
from ..weights.float8_weight import Float8Weight
from ..weights.module_weights import (
    is_frozen_parameter,
    restore_weight_precision,
    run_linear_eagerly,
    store_weight_in_fp8,
)
from .base import Float8Module

__all__ = ["Float8Linear"]


class Float8Linear(Float8Module, nn.Linear):
    """A drop-in ``nn.Linear`` whose output, grad_input and grad_weight GEMMs run in FP8.

    Same parameters and ``state_dict`` keys as ``nn.Linear``; with
    :class:`~fp8train.spec.recipes.DelayedScaling` it also holds the buffers ``fp8_scale``
    ``(3,)`` and ``fp8_amax_history`` ``(amax_history_len, 3)`` (columns: input, weight,
    grad_output). A frozen weight (``requires_grad=False``: a PEFT base layer's) takes,
    at each forward, the scale of its own amax, so that a LoRA merge or unmerge is never
    quantized with the scale of the weight it replaced.

    Inputs may have any rank and strides and be float32, bfloat16 or float16 (matching
    the weight, or under ``torch.autocast``). The flattened token dim is zero-padded
    internally to the recipe's block (128 blockwise, 32 MXFP8, 16 otherwise), which
    changes no scale and no sum. ``in_features`` and ``out_features`` must meet the
    recipe's alignment (:func:`fp8train.convert_to_float8_training` skips layers that do not).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        config: the options, one :class:`~fp8train.nn.config.Float8ModuleConfig` (default
            ``Float8ModuleConfig()``: ``"tensorwise"``, backend ``"auto"``): the recipe, the
            GEMM ``backend`` (``"auto"``, ``"emulated"`` or ``"hardware"``, see
            :func:`fp8train.quant.scaled_mm`) and ``save_fp8_activations`` (below).
        recipe: shorthand for ``config=Float8ModuleConfig(recipe=recipe)``: a
            :class:`~fp8train.spec.recipes.Recipe` or recipe name (not with ``config``).

    ``save_fp8_activations`` keeps the input for the backward as the grad_weight GEMM's FP8
    operand (data and scales, about half of a bfloat16 input), quantized in the forward,
    rather than in high precision; same results either way. ``False`` keeps it in high
    precision and quantizes it in the backward, except where that operand is the
    transpose of the forward's own FP8 input (``tensorwise``, ``delayed``), which is kept
    either way. Recipes whose grad_weight GEMM runs in high precision
    (``rowwise_with_gw_hp``) always keep the high-precision input.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        config: Float8ModuleConfig | None = None,
        recipe: Recipe | str | None = None,
    ) -> None:
        check_int("in_features", in_features, minimum=1)
        check_int("out_features", out_features, minimum=1)
        check_bool("bias", bias)
        config = Float8ModuleConfig.build(config, recipe=recipe)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(config)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        recipe: Recipe | str | None = None,
        *,
        config: Float8ModuleConfig | None = None,
    ) -> "Float8Linear":
        """A ``Float8Linear`` sharing ``linear``'s parameters (no copy); ``config`` or
        ``recipe`` as in the constructor.

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear``; ``config`` and ``recipe`` both given.
        """
        check_type("linear", linear, nn.Linear, "an nn.Linear")
        config = Float8ModuleConfig.build(config, recipe=recipe)
        return cls._adopt(
            linear,
            lambda: cls(linear.in_features, linear.out_features, bias=False, config=config),
            {"weight": linear.weight, "bias": linear.bias},
            linear.weight.device,
            keep_source=type(linear) is not nn.Linear,  # a subclass: to_linear gives that module back
        )

    def _new_original(self) -> nn.Linear:
        return nn.Linear(self.in_features, self.out_features, bias=False)

    def to_linear(self) -> nn.Linear:
        """:meth:`~Float8Module.to_original`: the module :meth:`from_linear` replaced where it
        was an ``nn.Linear`` subclass, else a new ``nn.Linear``."""
        return self.to_original()

    def _dims_repr(self) -> str:
        return nn.Linear.extra_repr(self)

    def _weight_frozen(self) -> bool:
        return is_frozen_parameter(self.weight)

    def fp8_weight_types(self) -> dict[str, type[Float8Weight]]:
        return {"weight": Float8Weight}

    def store_weight_in_fp8(self) -> None:
        """Hold the frozen weight in FP8 only (:class:`~fp8train.nn.weights.float8_weight.Float8Weight`; see
        :func:`fp8train.store_frozen_weights_in_fp8`). Raises ``ValueError`` where it requires grad."""
        store_weight_in_fp8(self, "weight")

    def restore_weight_precision(self) -> None:
        """Undo :meth:`store_weight_in_fp8`: a plain frozen weight of the dequantized values."""
        restore_weight_precision(self, "weight")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The parameters from the module's own dict: an attribute read is nn.Module.__getattr__'s
        # call (issue 38); as attributes where one is not there (a parametrization's property).
        parameters = self._parameters
        if "weight" in parameters and "bias" in parameters:
            weight, bias = parameters["weight"], parameters["bias"]
        else:
            weight, bias = self.weight, self.bias
        # (a plain parameter's type test first: no isinstance() call, issue 38)
        if type(weight) not in PLAIN_TENSOR_TYPES and isinstance(weight, Float8Weight):
            return run_linear_eagerly(self, input, weight, bias)  # torch.compile: runs eagerly (a graph break)
        return self.run_linear(input, weight, bias)
