"""Tensor and sequence parallelism with FP8 GEMMs: parallel styles for
``torch.distributed.tensor.parallel.parallelize_module``, named and called as PyTorch's
(and torchao's) are.

| style | parameters | forward | backward |
|---|---|---|---|
| :class:`Float8ColwiseParallel` | weight and bias ``Shard(0)`` | input gathered (in FP8 from a ``Shard(1)`` sequence-parallel input), local GEMM, output ``Shard(-1)`` | input's gradient reduce-scattered (high precision) |
| :class:`Float8RowwiseParallel` | weight ``Shard(1)``, bias ``Replicate()`` | local GEMM on the ``Shard(-1)`` input, partial outputs reduced (high precision), bias added after | into ``Shard(1)``: grad_output all-gathered in FP8 |
| :class:`PrepareFloat8ModuleInput` | none | an input gathered once in FP8, for every consumer (an MLP's ``w1`` and ``w3``) | one reduce-scatter of the summed gradients |

On a ``Float8Linear`` the parameters become ``DTensor`` s as PyTorch's styles make them (so
optimizers, ``clip_grad_norm_``, state dicts and FSDP2 on a 2-D mesh see the usual
layout), and its forward runs the FP8 GEMMs on the local shards
(:meth:`~fp8train.nn.modules.linear.Float8Module.run_linear`). Other modules (a plain ``nn.Linear``
left in high precision, an ``nn.Embedding``) get PyTorch's own style. What is gathered in
which precision, per recipe, is in :mod:`.sequence_gather` and ``docs/parallel.md``.

Each rank's GEMMs quantize its own slice of the weight, and of a feature-sharded input or
grad_output, with scales of their own (as Transformer Engine does); only tensors that are
gathered share scales across the group.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from ..nn.modules.base import Float8Module
from ..nn.modules.linear import Float8Linear
from ..spec.checks import check_type
from ..spec.recipes import Recipe, recipe_label, resolve_recipe
from .sequence_gather import gather_activation, reduce_scatter_output

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]


def _check_mesh(style: object, mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        raise ValueError(
            f"{type(style).__name__} takes a 1-D tensor-parallel mesh, got a {mesh.ndim}-D one "
            f"(dims {mesh.mesh_dim_names or 'unnamed'}); pass its tensor-parallel dim, e.g. mesh['tp']"
        )


def _check_split(module: Float8Linear, dim_name: str, size: int, world: int) -> None:
    """A shard of ``size`` features over ``world`` ranks must be whole and tile the recipe's block."""
    block = module.recipe.operand_plan.block
    if size % world or (block and (size // world) % block):
        need = f"a multiple of {world * max(block, 1)}"
        raise ValueError(
            f"tensor parallelism over {world} ranks splits {dim_name}={size} of {module} into {size / world:g} per "
            f"rank; the {recipe_label(module.recipe)} recipe needs {need} (whole {block}-element blocks per rank): use a "
            "smaller tensor-parallel size, a width that divides, or leave this layer out of the plan"
        )


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _distribute(module: Float8Linear, mesh: DeviceMesh, partition_fn, input_fn, output_fn, forward) -> Float8Linear:
    """``distribute_module``, then the module's FP8 forward on local shards. Its buffers
    (delayed-scaling state) stay plain tensors, one per rank, which the step's amax
    all-reduce keeps identical across ranks."""
    module = distribute_module(module, mesh, partition_fn, input_fn, output_fn)
    for name, buffer in module._buffers.items():
        if isinstance(buffer, DTensor):
            module._buffers[name] = buffer.to_local()
    module.forward = types.MethodType(forward, module)
    return module


class Float8ColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for ``Float8Linear``: the output features are split across the
    ranks, each rank runs the three GEMMs in FP8 on its slice.

    Keyword Args (as ``ColwiseParallel``):
        input_layouts: the layout of the input (default ``Replicate()``). ``Shard(1)``
            (sequence parallel) all-gathers it, in FP8 where the recipe allows
            (:func:`~.sequence_gather.activation_gather_plan`; else in high precision,
            logged once); its gradient is reduce-scattered back in high precision.
        output_layouts: the layout of the output (default ``Shard(-1)``).
        use_local_output: return a plain tensor rather than a ``DTensor`` (default ``True``).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Float8Linear):
            return super()._apply(module, device_mesh)
        _check_mesh(self, device_mesh)
        _check_split(module, "out_features", module.out_features, device_mesh.size())
        input_layout = self.input_layouts[0]
        return _distribute(
            module,
            device_mesh,
            self._partition_linear_fn,
            lambda mod, inputs, mesh: _colwise_input(mod, inputs, mesh, input_layout),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            _colwise_forward,
        )


def _colwise_input(module: Float8Linear, inputs: tuple, mesh: DeviceMesh, layout: Placement) -> DTensor:
    x = inputs[0]
    if isinstance(x, DTensor):
        if x.placements == (Replicate(),):
            return x  # already gathered (by PrepareFloat8ModuleInput, maybe in FP8)
        layout, x = x.placements[0], x.to_local()
    if layout == Replicate():
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
    return gather_activation(x, layout, mesh, module, None)


def _colwise_forward(module: Float8Linear, input: DTensor) -> DTensor:
    """The GEMMs on this rank's output features; the input's gradient is a partial sum."""
    x = input.to_local(grad_placements=(Partial(),)) if isinstance(input, DTensor) else input
    bias = _local(module.bias) if module.bias is not None else None
    output = module.run_linear(x, _local(module.weight), bias)
    return DTensor.from_local(output, module.weight.device_mesh, (Shard(-1),), run_check=False)


class Float8RowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for ``Float8Linear``: the input features are split across the
    ranks, each rank runs the three GEMMs in FP8 on its slice and the partial outputs are
    summed (all-reduce, or reduce-scatter into ``Shard(1)``, in high precision); the bias
    is added once, after the sum.

    Keyword Args (as ``RowwiseParallel``):
        input_layouts: the layout of the input (default ``Shard(-1)``).
        output_layouts: the layout of the output (default ``Replicate()``). ``Shard(1)``
            (sequence parallel) reduce-scatters the output, and the backward all-gathers
            the gradient, the layer's grad_output, in FP8 where the recipe allows.
        use_local_output: return a plain tensor rather than a ``DTensor`` (default ``True``).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Float8Linear):
            return super()._apply(module, device_mesh)
        _check_mesh(self, device_mesh)
        _check_split(module, "in_features", module.in_features, device_mesh.size())
        desired = (Shard(-1),)
        output_layout = self.output_layouts[0]
        return _distribute(
            module,
            device_mesh,
            self._partition_linear_fn,
            lambda mod, inputs, mesh: self._prepare_input_fn(self.input_layouts, desired, mod, inputs, mesh),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            lambda mod, input: _rowwise_forward(mod, input, output_layout),
        )


def _rowwise_forward(module: Float8Linear, input, output_layout: Placement) -> DTensor:
    output = module.run_linear(_local(input), _local(module.weight), None)
    output = reduce_scatter_output(output, output_layout, module.weight.device_mesh, module)
    if module.bias is not None:
        output = output + module.bias.to(output.dtype)
    return output


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """``PrepareModuleInput`` that all-gathers a sequence-parallel input in FP8 once, for
    every ``Float8ColwiseParallel`` layer that consumes it (an MLP's ``w1`` and ``w3``,
    attention's ``wq``, ``wk``, ``wv``): one quantization, one gather, and in the backward
    one reduce-scatter of the consumers' summed gradients.

    Keyword Args:
        input_layouts, desired_input_layouts, input_kwarg_layouts,
        desired_input_kwarg_layouts, use_local_output: as ``PrepareModuleInput``. An input
            going from ``Shard(d)`` to ``Replicate()`` is gathered in FP8 where the recipe
            allows; every other change is PyTorch's, in high precision.
        recipe: the recipe to quantize with (a :class:`~fp8train.spec.recipes.Recipe` or
            name): the consumers' recipe, which the layers check. Default: the recipe of
            ``fwd_config_submodule_fqn``, else of the first ``Float8Linear`` inside the
            module. An ``fp8train.autocast`` recipe override wins, as it does for the layers.
        fwd_config_submodule_fqn: the submodule (a ``Float8Linear`` consumer) whose recipe,
            and whose delayed-scaling input scale, the gather uses.

    Raises:
        ValueError: ``fwd_config_submodule_fqn`` names no ``Float8Module``; a delayed
            recipe with no module to take the scale from.
    """

    def __init__(
        self,
        *,
        input_layouts=None,
        desired_input_layouts=None,
        input_kwarg_layouts=None,
        desired_input_kwarg_layouts=None,
        use_local_output: bool = False,
        recipe: Recipe | str | None = None,
        fwd_config_submodule_fqn: str | None = None,
    ) -> None:
        super().__init__(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_output,
        )
        self.recipe = resolve_recipe(recipe) if recipe is not None else None
        if fwd_config_submodule_fqn is not None:
            check_type("fwd_config_submodule_fqn", fwd_config_submodule_fqn, str, "a submodule name")
        self.fwd_config_submodule_fqn = fwd_config_submodule_fqn
        self._owner: Float8Module | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(self, device_mesh)
        bound = copy.copy(self)  # one style may prepare several modules, each with its own owner
        bound._owner = self._find_owner(module)
        return PrepareModuleInput._apply(bound, module, device_mesh)

    def _find_owner(self, module: nn.Module) -> Float8Module | None:
        if self.fwd_config_submodule_fqn is not None:
            try:
                owner = module.get_submodule(self.fwd_config_submodule_fqn)
            except AttributeError:
                owner = None
            if not isinstance(owner, Float8Module):
                raise ValueError(
                    f"fwd_config_submodule_fqn={self.fwd_config_submodule_fqn!r} is not a converted FP8 submodule of "
                    f"{type(module).__name__}; name one of its Float8Linear layers that consume the input"
                )
            return owner
        owner = next((m for m in module.modules() if isinstance(m, Float8Linear)), None)
        if self.recipe is None or (owner is not None and owner.recipe == self.recipe):
            return owner
        if self.recipe.operand_plan.delayed:
            raise ValueError(
                f"PrepareFloat8ModuleInput(recipe={recipe_label(self.recipe)!r}) needs a module with delayed-scaling state to "
                "take the input scale from: pass fwd_config_submodule_fqn naming a consumer"
            )
        return None

    def _prepare_input_arg(self, input: Any, mesh: DeviceMesh, input_layout, desired_layout):
        if isinstance(input, DTensor) and isinstance(input_layout, Shard) and input.placements == (input_layout,):
            input = input.to_local()
        if (
            isinstance(input_layout, Shard)
            and desired_layout == Replicate()
            and not isinstance(input, DTensor)
            and (self._owner is not None or self.recipe is not None)
        ):
            gathered = gather_activation(input, input_layout, mesh, self._owner, self.recipe)
            return gathered.to_local() if self.use_local_output else gathered
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
