"""What a training run keeps between steps, in bytes: its weights (parameters and buffers),
one gradient per trainable parameter, and the optimizer's state. Reported per run
(``TrainResult["state_bytes"]``) and by ``fp8train compare``, so one command shows memory
and loss side by side. The bytes are this process's: under FSDP2, its shards."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["tensor_bytes", "training_state_bytes", "state_bytes_per_parameter"]


def _leaves(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that hold ``tensor``'s bytes: a DTensor's (FSDP2) local shard, a wrapper
    subclass's inner tensors (an FP8 all-gather weight, a weight stored in FP8), else itself."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _leaves(getattr(tensor, name))
    else:
        yield tensor


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``' storages, each counted once (a view shares its base's)."""
    seen, total = set(), 0
    for leaf in (leaf for tensor in tensors for leaf in _leaves(tensor)):
        storage = leaf.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]


def _reshard(model: nn.Module) -> None:
    """Put FSDP2's sharded parameters back in ``model`` (``FSDPModule.reshard``), as they
    are between steps. After a forward without a backward (evaluation) the root module
    keeps the gathered, whole ones: counted, they would be every rank's bytes, and a weight
    gathered in FP8 is a wrapper with no storage of its own."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local_numel(parameter: torch.Tensor) -> int:
    return parameter.to_local().numel() if isinstance(parameter, DTensor) else parameter.numel()


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``{"parameters": count, "weights": bytes, "gradients": bytes, "optimizer_state":
    bytes}``: the model's parameter count; the bytes this process keeps between steps
    (under FSDP2 or tensor parallelism its shards, with FSDP2's modules resharded first) of
    its parameters and buffers, of a gradient of its parameter's dtype for each trainable
    parameter (what a step holds, whether or not ``.grad`` is set now), and of every tensor
    in the optimizer's state (masters, moments, scales, step counts)."""
    _reshard(model)
    parameters = list(model.parameters())
    trainable = [p for p in parameters if p.requires_grad]
    return {
        "parameters": sum(p.numel() for p in parameters),
        "weights": tensor_bytes([*parameters, *model.buffers()]),
        "gradients": sum(_local_numel(p) * p.element_size() for p in trainable),
        "optimizer_state": tensor_bytes(_state_tensors(optimizer)),
    }


def state_bytes_per_parameter(state_bytes: dict) -> str:
    """``"w + g + o = total"``: a run's weights, gradients and optimizer state in bytes per
    parameter (:func:`~fp8train.train.memory.training_state_bytes`)."""
    per = {key: state_bytes[key] / state_bytes["parameters"] for key in ("weights", "gradients", "optimizer_state")}
    return f"{per['weights']:.1f} + {per['gradients']:.1f} + {per['optimizer_state']:.1f} = {sum(per.values()):.1f}"
