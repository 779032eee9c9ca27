"""One module's weights stored in FP8: storing a frozen one, giving any one back its high
precision, and what the module's ``state_dict`` saves and loads for them (trainable
weights, frozen ones and FSDP2's shards of them alike).

A frozen weight (``requires_grad=False``: a PEFT base layer's, a frozen backbone's) never
gets a gradient, so the layer skips its grad_weight GEMM and keeps nothing of the input
for it (:class:`~fp8train.nn.function.Float8LinearFunction` reads ``needs_input_grad``);
what remains is its high-precision copy, which :func:`store_weight_in_fp8` replaces by a
:class:`~fp8train.nn.weights.float8_weight.Float8Weight`. The functions here act on one
module and one of its parameters, for the module's own methods
(``Float8Linear.store_weight_in_fp8``, its ``state_dict`` and loading); the model walk is
:mod:`fp8train.nn.store_weights`, and a frozen weight's delayed scale
:mod:`fp8train.nn.weights.delayed_scale`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...spec.roles import Role
from .delayed_scale import rescale_frozen_weight
from .float8_weight import Float8Weight
from .master import MasterHeldWeight

__all__ = [
    "is_frozen_parameter",
    "run_linear_eagerly",
    "store_weight_in_fp8",
    "restore_weight_precision",
    "dequantize_stored_weights",
    "take_stored_weights",
    "requantize_stored_weights",
]

def is_frozen_parameter(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a parameter of this process that does not train (a PEFT base
    layer's): ``requires_grad`` off, a plain parameter or one stored in FP8 only, and not
    sharded (a DTensor, or FSDP2's FP8 all-gather)."""
    return (type(weight) is nn.Parameter or isinstance(weight, Float8Weight)) and not weight.requires_grad


@torch.compiler.disable
def run_linear_eagerly(module: nn.Module, input: torch.Tensor, weight: Float8Weight, bias) -> torch.Tensor:
    """``module.run_linear`` outside ``torch.compile`` (which does not trace a
    :class:`Float8Weight`): a compiled model runs such a layer eagerly, the rest compiled."""
    return module.run_linear(input, weight, bias)


def _quantized(
    module: nn.Module, weight_hp: torch.Tensor, into: Float8Weight | None = None, name: str = ""
) -> Float8Weight:
    """``weight_hp`` quantized for ``module``'s recipe (into ``into`` where given, else as
    the class ``module.fp8_weight_types()`` names for its parameter ``name``), with
    the scale the module's forward would use for it: under delayed scaling, after
    :func:`rescale_frozen_weight`, which the forward would run first."""
    plan = module.recipe.operand_plan
    scale = None
    if plan.delayed:
        rescale_frozen_weight(module.delayed_state, weight_hp)
        scale = module.delayed_state.scale[Role.WEIGHT.index]
    if into is not None:
        return into.requantize_(weight_hp, scale)
    return module.fp8_weight_types()[name].quantize(weight_hp, plan, scale)


def store_weight_in_fp8(module: nn.Module, name: str) -> None:
    """Replace ``module``'s frozen parameter ``name`` (one of ``module.fp8_weight_types()``)
    by a :class:`Float8Weight` of that class for the module's recipe, freeing the high-precision
    tensor (unless something else holds it). A no-op where it is stored so already. A
    trainable FP8 weight (``fp8_weights=True``) frozen since (a PEFT base layer) becomes a
    frozen one, from its master's value: its link to a master (and a pending
    high-precision copy) goes.

    Raises:
        ValueError: the parameter requires grad.
        TypeError: it is not a plain parameter (sharded: a DTensor, FSDP2's).
    """
    weight = getattr(module, name)
    if isinstance(weight, Float8Weight) and (weight.fp8_master is None or weight.requires_grad):
        return
    if isinstance(weight, Float8Weight):
        stored = _quantized(module, weight.checkpoint_value(), name=name)
        setattr(module, name, nn.Parameter(stored, requires_grad=False))
        return
    if weight.requires_grad:
        raise ValueError(
            f"{name} requires grad, so it trains and needs its high-precision copy; freeze it first "
            f"({name}.requires_grad_(False)) to store it in FP8 only"
        )
    if not is_frozen_parameter(weight):
        raise TypeError(f"{name} is a {type(weight).__name__}: only a plain, unsharded parameter is stored in FP8")
    setattr(module, name, nn.Parameter(_quantized(module, weight.detach(), name=name), requires_grad=False))


def restore_weight_precision(module: nn.Module, name: str) -> None:
    """Replace ``module``'s :class:`Float8Weight` ``name`` by a plain parameter of its
    dtype: a frozen one holding its dequantized values, a trainable one (``fp8_weights``)
    its master's (:meth:`Float8Weight.checkpoint_value`), still trainable. A no-op where it
    is not stored in FP8."""
    weight = getattr(module, name)
    if isinstance(weight, Float8Weight):
        setattr(module, name, nn.Parameter(weight.checkpoint_value(), requires_grad=weight.requires_grad))


def dequantize_stored_weights(module: nn.Module, destination: dict, prefix: str) -> None:
    """In a ``state_dict`` being saved, a plain tensor in place of each of ``module``'s
    :class:`Float8Weight` parameters (:meth:`Float8Weight.checkpoint_value`: the master of a
    trainable one, else the dequantized weight): checkpoints hold loadable weights."""
    for name, param in module._parameters.items():
        if isinstance(param, Float8Weight) and prefix + name in destination:
            destination[prefix + name] = param.checkpoint_value()
        elif _sharded_stored(param) and prefix + name in destination:  # FSDP2's shard: a DTensor of its rows
            destination[prefix + name] = DTensor.from_local(
                param._local_tensor.checkpoint_value(), param.device_mesh, param.placements, run_check=False,
                shape=param.shape, stride=param.stride(),
            )


def _sharded_stored(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ``DTensor`` whose local shard is stored in FP8 (FSDP2's shard
    of an FP8 weight, :class:`~fp8train.parallel.fp8_weight_shard.Float8WeightShard`)."""
    return isinstance(param, DTensor) and isinstance(param._local_tensor, MasterHeldWeight)


def take_stored_weights(module: nn.Module, state_dict: dict, prefix: str) -> dict[str, torch.Tensor]:
    """Pop from a ``state_dict`` being loaded the entries of ``module``'s
    :class:`Float8Weight` parameters (which :func:`requantize_stored_weights` then loads):
    ``{name: high-precision tensor}``."""
    return {
        name: state_dict.pop(prefix + name)
        for name, param in module._parameters.items()
        if (isinstance(param, Float8Weight) or _sharded_stored(param)) and prefix + name in state_dict
    }


def requantize_stored_weights(
    module: nn.Module, taken: dict[str, torch.Tensor], prefix: str, missing_keys: list, error_msgs: list
) -> None:
    """Load the entries :func:`take_stored_weights` took: each :class:`Float8Weight`
    re-quantized from its checkpoint tensor (after the module's FP8 state has loaded,
    so that delayed scaling's weight scale is the new weight's, or for a trainable weight
    the loaded scale); a trainable weight's master takes the tensor too
    (:meth:`~fp8train.nn.weights.master.WeightMaster.load`)."""
    for name, weight_hp in taken.items():
        param = module._parameters[name]
        if _sharded_stored(param):  # each rank loads its rows (of a DTensor, or of its own shape)
            param = param._local_tensor
            weight_hp = weight_hp.to_local() if isinstance(weight_hp, DTensor) else weight_hp
        if tuple(weight_hp.shape) != tuple(param.shape):
            error_msgs.append(
                f"size mismatch for {prefix}{name}: copying a param with shape {tuple(weight_hp.shape)} from "
                f"checkpoint, the shape in current model is {tuple(param.shape)}."
            )
            continue
        weight_hp = weight_hp.to(device=param.device, dtype=param.dtype)
        if param.fp8_master is not None:
            with torch.no_grad():
                param.load_(weight_hp)
        else:
            _quantized(module, weight_hp, into=param)
        if prefix + name in missing_keys:
            missing_keys.remove(prefix + name)
