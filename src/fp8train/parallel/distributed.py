"""Process groups, model wrapping (DDP or FSDP2) and full-state checkpoints for the trainer.

Launch with ``torchrun``: ``init_distributed`` reads its environment (``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``) and starts ``gloo`` on CPU or ``nccl`` on CUDA.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ..nn.linear import Float8Linear
from .fsdp import Float8AllGatherWeight, enable_fp8_all_gather, precompute_fp8_scales_for_fsdp

__all__ = [
    "STRATEGIES",
    "init_distributed",
    "resolve_strategy",
    "wrap_model",
    "full_model_state_dict",
    "load_full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_optimizer_state_dict",
    "after_optimizer_step",
    "is_main_process",
]

STRATEGIES = ("auto", "none", "ddp", "fsdp2")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Start the default process group under ``torchrun`` (no-op otherwise).

    Returns:
        ``(rank, world_size)``.
    """
    if world_size_from_env() > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """Rank 0, or the only process."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def resolve_strategy(strategy: str, world_size: int) -> str:
    """``auto``: DDP with more than one process, else none; the others as named (``ddp``
    and ``fsdp2`` also run in a single process).

    Raises:
        ValueError: an unknown strategy.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {', '.join(STRATEGIES)}")
    if strategy == "auto":
        return "ddp" if world_size > 1 else "none"
    return strategy


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    """What to shard separately: transformer blocks when the model has a ``blocks`` list,
    else every Linear; the root is sharded last."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def wrap_model(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """The module to run forward through: ``model`` itself (none, and FSDP2, which shards it
    in place) or a ``DistributedDataParallel`` wrapper."""
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if any(isinstance(m, Float8Linear) for m in model.modules()):
            enable_fp8_all_gather(model)
        for unit in _fsdp_units(model):
            fully_shard(unit)
        fully_shard(model)
    return model


def after_optimizer_step(model: nn.Module, strategy: str) -> None:
    """FSDP2: precompute every tensorwise FP8 weight scale for the next all-gather (one
    batched all-reduce)."""
    if strategy == "fsdp2":
        precompute_fp8_scales_for_fsdp(model)


def _full_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kwargs)


def full_model_state_dict(model: nn.Module, strategy: str) -> dict:
    """The whole, unsharded ``state_dict`` (a collective under FSDP2: every rank calls it)."""
    if strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model, options=_full_options())
    else:
        state = model.state_dict()
    return {key: _plain(value).detach().contiguous().cpu() for key, value in state.items()}


def _plain(value: torch.Tensor) -> torch.Tensor:
    return value.high_precision() if isinstance(value, Float8AllGatherWeight) else value


def load_full_model_state_dict(model: nn.Module, state: dict, strategy: str) -> None:
    """Load a whole ``state_dict`` (as saved by :func:`full_model_state_dict`)."""
    if strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state, options=_full_options())
    else:
        model.load_state_dict(state)


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str) -> dict:
    """The optimizer's whole state (a collective under FSDP2)."""
    if strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_full_options())
    return optimizer.state_dict()


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, strategy: str) -> None:
    if strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=_full_options())
    else:
        optimizer.load_state_dict(state)
