"""``Float8Conv1D``: transformers' ``Conv1D`` (GPT-2's projections) with FP8 GEMMs.

``Conv1D`` is a Linear layer whose weight is stored transposed: ``y = x @ W + b`` with
``W[in, out]`` (``nx`` inputs, ``nf`` outputs). :class:`Float8Conv1D` keeps that parameter
as it is (same ``state_dict`` keys and shapes) and runs the three GEMMs of ``x @ (W^T)^T``
through :meth:`~fp8train.nn.modules.linear.Float8Module.run_linear` on the view ``W.t()``; the
gradient reaches ``W`` through the view's transpose.

Its weight may be held only quantized (``fp8_weights=True``; ``store_frozen_weights_in_fp8``
for a frozen one), as a :class:`~fp8train.nn.weights.transposed.TransposedFloat8Weight`:
the parameter stays ``[in, out]``, its ``.t()`` is the ``[out, in]`` FP8 weight the GEMMs take.

transformers is not imported to convert: a module is recognized by its class's name and
module (:func:`is_transformers_conv1d`); only :meth:`Float8Conv1D.to_conv1d` imports it.
"""

from __future__ import annotations

import torch
from torch import nn

from ...spec.checks import check_int
from ...spec.recipes import Recipe
from ..config import Float8ModuleConfig
from .base import Float8Module
from ..weights.module_weights import is_frozen_parameter
from ..weights.float8_weight import Float8Weight
from ..weights.transposed import TransposedFloat8Weight

__all__ = ["Float8Conv1D", "is_transformers_conv1d", "CONV1D_CLASS"]

CONV1D_CLASS = ("transformers.pytorch_utils", "Conv1D")
"""``(module, name)`` of transformers' ``Conv1D`` class."""


def is_transformers_conv1d(module: object) -> bool:
    """Whether ``module``'s class is transformers' ``Conv1D`` itself (not a subclass, which
    may compute something else), without importing transformers."""
    cls = type(module)
    return (cls.__module__, cls.__qualname__) == CONV1D_CLASS


class Float8Conv1D(Float8Module):
    """transformers' ``Conv1D`` whose output, grad_input and grad_weight GEMMs run in FP8.

    Same parameters as ``Conv1D``: ``weight`` ``[nx, nf]`` (in, out) and ``bias`` ``[nf]``,
    and the same ``state_dict`` keys; with delayed scaling also ``fp8_scale`` and
    ``fp8_amax_history``, as :class:`~fp8train.nn.modules.linear.Float8Linear`. Inputs as
    ``Float8Linear``'s (any rank and strides; float32, bfloat16 or float16, or under
    ``torch.autocast``); ``nf`` and ``nx`` must meet the recipe's alignment. Under
    ``fp8train.autocast(enabled=False)`` it computes ``F.linear(x, W.t(), b)``, which is
    ``Conv1D``'s ``addmm`` bit for bit.

    Args:
        nf: output features (``Conv1D``'s first argument).
        nx: input features.
        device, dtype: of the (uninitialized) parameters.
        config, recipe: as :class:`~fp8train.nn.modules.linear.Float8Linear`.
    """

    def __init__(
        self,
        nf: int,
        nx: int,
        device=None,
        dtype=None,
        *,
        config: Float8ModuleConfig | None = None,
        recipe: Recipe | str | None = None,
    ) -> None:
        check_int("nf", nf, minimum=1)
        check_int("nx", nx, minimum=1)
        config = Float8ModuleConfig.build(config, recipe=recipe)
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(nf, device=device, dtype=dtype))
        self._init_fp8(config)

    @property
    def in_features(self) -> int:
        return self.nx

    @property
    def out_features(self) -> int:
        return self.nf

    @classmethod
    def from_conv1d(
        cls,
        conv1d: nn.Module,
        recipe: Recipe | str | None = None,
        *,
        config: Float8ModuleConfig | None = None,
    ) -> "Float8Conv1D":
        """A ``Float8Conv1D`` sharing ``conv1d``'s parameters (no copy); ``config`` or
        ``recipe`` as in the constructor.

        Raises:
            TypeError: ``conv1d`` is not a transformers ``Conv1D``.
        """
        if not is_transformers_conv1d(conv1d):
            raise TypeError(f"conv1d must be a transformers Conv1D, got {type(conv1d).__name__}")
        config = Float8ModuleConfig.build(config, recipe=recipe)
        parameters = {"weight": conv1d.weight, "bias": conv1d.bias}
        return cls._adopt(conv1d, lambda: cls(conv1d.nf, conv1d.nx, config=config), parameters, conv1d.weight.device)

    def _new_original(self) -> nn.Module:
        from transformers.pytorch_utils import Conv1D

        return Conv1D(self.nf, self.nx)

    def to_conv1d(self) -> nn.Module:
        """:meth:`~fp8train.nn.modules.linear.Float8Module.to_original`: a new transformers ``Conv1D``.

        Raises:
            ImportError: transformers is not installed.
        """
        return self.to_original()

    def _dims_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"

    def _weight_frozen(self) -> bool:
        return is_frozen_parameter(self.weight)

    def fp8_weight_types(self) -> dict[str, type[Float8Weight]]:
        return {"weight": TransposedFloat8Weight}

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, Float8Weight):  # torch.compile: runs eagerly (a graph break)
            return _run_stored_eagerly(self, input)
        return self.run_linear(input, self.weight.t(), self.bias)


@torch.compiler.disable
def _run_stored_eagerly(module: Float8Conv1D, input: torch.Tensor) -> torch.Tensor:
    """``module``'s forward on its weight stored in FP8, outside ``torch.compile`` (which does
    not trace a :class:`Float8Weight`)."""
    return module.run_linear(input, module.weight, module.bias, transposed=True)

