"""Process groups, model wrapping (DDP or FSDP2) and full-state checkpoints for the trainer.

Launch with ``torchrun``: ``init_distributed`` reads its environment (``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``) and starts ``gloo`` on CPU or ``nccl`` on CUDA, one GPU per
rank, with a timeout on every collective; ``torchrun --nproc-per-node 1`` starts a real
group of one process, so DDP and FSDP2 run there as they do on N. ``report_rank_failures``
(:mod:`.rank_failures`) turns the backend's error when a peer fails into a
:class:`RankFailedError` that names the rank that failed.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..nn.collective_device import collective_device
from ..nn.modules.linear import Float8Linear
from ..spec.checks import check_int, check_number
from .fsdp import Float8AllGatherWeight, enable_fp8_all_gather, precompute_fp8_scales_for_fsdp
from .local_optimizer_state import LOCAL_ROWS_KEY, gather_local_state, holds_local_state, load_local_state
from .rank_failures import RankFailedError, report_rank_failures  # re-exported: the trainer's and users' import path

__all__ = [
    "STRATEGIES",
    "DEFAULT_TIMEOUT_SECONDS",
    "RankFailedError",
    "init_distributed",
    "process_group_backend",
    "close_distributed",
    "mean_over_ranks",
    "report_rank_failures",
    "resolve_strategy",
    "wrap_model",
    "apply_tensor_parallel",
    "full_model_state_dict",
    "load_full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_optimizer_state_dict",
    "after_optimizer_step",
    "is_main_process",
]

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "none", "ddp", "fsdp2")
DEFAULT_TIMEOUT_SECONDS = 600.0  # PyTorch's own default is 1800 s for gloo, 600 s for nccl


def launched_by_torchrun() -> bool:
    """Whether a launcher (``torchrun``, or one that sets its environment) started this
    process: ``WORLD_SIZE`` is set, whatever its value (1 included)."""
    return "WORLD_SIZE" in os.environ


def process_group_backend(device: torch.device) -> str:
    """The backend a rank training on ``device`` starts: ``nccl`` for CUDA, else ``gloo``."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device: torch.device, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> tuple[int, int]:
    """Start the default process group under ``torchrun``, at any world size (a group of
    one process under ``--nproc-per-node 1``); without a launcher, no-op.

    On CUDA (``nccl``), each rank is bound to its own GPU, ``device`` (``cuda:LOCAL_RANK``),
    before the group starts: ``torch.cuda.set_device(device)`` and ``device_id=device``.
    FSDP2, ``DeviceMesh``, ``barrier`` and the object collectives use the current CUDA
    device, which is otherwise GPU 0 on every rank.

    Args:
        device: the rank's device: ``cuda:<LOCAL_RANK>`` starts ``nccl``, anything else ``gloo``.
        timeout_seconds: how long a collective (and the start-up rendezvous) waits for a
            rank that does not join before it fails (gloo raises; nccl's watchdog ends the
            process). A group started elsewhere keeps its own timeout.

    Returns:
        ``(rank, world_size)``.

    Raises:
        TypeError: ``timeout_seconds`` is not a number.
        ValueError: ``timeout_seconds`` is not finite and > 0; ``device`` is CUDA without
            an index under torchrun.
    """
    check_number("timeout_seconds", timeout_seconds, minimum=0, exclusive=True, kind="a finite number of seconds")
    device = torch.device(device)
    launched = launched_by_torchrun()
    if launched and device.type == "cuda":
        if device.index is None:
            raise ValueError(
                f"init_distributed(device={str(device)!r}) under torchrun needs the rank's own GPU: pass "
                "torch.device('cuda', LOCAL_RANK)"
            )
        torch.cuda.set_device(device)  # first: before anything initialises CUDA on another GPU
    if launched and not dist.is_initialized():
        options = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            process_group_backend(device), timeout=datetime.timedelta(seconds=timeout_seconds), **options
        )
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def close_distributed() -> None:
    """End the process group :func:`init_distributed` started, once every rank is done
    (a barrier first). A gloo group left to interpreter exit can abort the process there
    ("terminate called without an active exception") after a successful run.

    Call it after dropping every reference to a ``DistributedDataParallel`` model (the
    trainer that holds it): garbage is collected first, so no DDP ``Reducer`` outlives the
    group. A Reducer destroyed after it holds the group's last reference and runs gloo's
    destructor, which joins gloo's worker threads while holding the GIL one of them may be
    waiting for: the process hangs at exit.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # a Reducer in a reference cycle would otherwise be freed after the group
        dist.barrier()
        dist.destroy_process_group()


def is_main_process() -> bool:
    """Rank 0, or the only process."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def mean_over_ranks(value: float, group: object | None = None) -> float:
    """The mean of ``value`` over the ranks of ``group`` (default: the world), summed in
    float64 on the group's device (nccl takes no CPU tensor); ``value`` itself without a
    process group of more than one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    total = torch.tensor(value, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(total, group=group)
    return total.item() / dist.get_world_size(group)


def resolve_strategy(strategy: str, world_size: int, tp: int = 1) -> str:
    """``auto``: DDP with more than one process, else none (with tensor parallelism over
    ``tp`` ranks: FSDP2 over the data-parallel groups, none when there is one); the others
    as named. ``ddp`` and ``fsdp2`` need a process group, of any size: ``torchrun
    --nproc-per-node 1`` runs them in one process.

    Raises:
        ValueError: an unknown strategy; ``ddp`` with ``tp`` > 1; ``ddp`` or ``fsdp2``
            without a process group (not launched by torchrun).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {', '.join(STRATEGIES)}")
    if strategy == "auto":
        return ("ddp" if tp == 1 else "fsdp2") if world_size > tp else "none"
    if strategy == "ddp" and tp > 1:
        raise ValueError(
            f"strategy='ddp' with tp={tp} is not supported: use strategy='fsdp2' (data parallel x tensor parallel "
            "on a 2-D mesh) or strategy='none' (tensor parallel alone)"
        )
    if strategy in ("ddp", "fsdp2") and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"strategy={strategy!r} needs a process group, and this process has none: launch it with torchrun "
            f"(torchrun --nproc-per-node 1 -m fp8train train ... runs {strategy} in one process), or use "
            "strategy='none' (or 'auto')"
        )
    return strategy


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    """What to shard separately: transformer blocks when the model has a ``blocks`` list,
    else every Linear; the root is sharded last."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def wrap_model(model: nn.Module, strategy: str, device: torch.device, tp: int = 1) -> nn.Module:
    """The module to run forward through: ``model`` itself (none, and FSDP2, which shards it
    in place) or a ``DistributedDataParallel`` wrapper.

    With ``tp`` > 1, ``model`` is first split over groups of ``tp`` consecutive ranks by
    its ``tensor_parallel_plan()`` (:func:`apply_tensor_parallel`); FSDP2 then shards over
    the data-parallel dim of the 2-D mesh."""
    dp_mesh = apply_tensor_parallel(model, tp, strategy, device) if tp > 1 else None
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if any(isinstance(m, Float8Linear) for m in model.modules()):
            enable_fp8_all_gather(model, shard_world_size=dp_mesh.size() if dp_mesh is not None else None)
        mesh = dp_mesh if dp_mesh is not None else _world_mesh(device)
        for unit in _fsdp_units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _world_mesh(device: torch.device):
    """A 1-D mesh of every rank on ``device``'s type, or ``None`` without a process group.
    FSDP2's own default is torch's accelerator (CUDA wherever there is one), whatever
    device the model trains on."""
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return init_device_mesh(device.type, (dist.get_world_size(),))


def apply_tensor_parallel(model: nn.Module, tp: int, strategy: str, device: torch.device):
    """Split ``model`` over tensor-parallel groups of ``tp`` consecutive ranks with
    ``parallelize_module`` and the plan of its ``tensor_parallel_plan()`` method.

    Returns:
        The data-parallel mesh FSDP2 shards over (``strategy="fsdp2"``: the ``"dp"`` dim of
        a ``("dp", "tp")`` mesh), or ``None`` (tensor parallel alone: ``tp`` processes).

    Raises:
        ValueError: ``tp`` does not divide the number of processes, or leaves data-parallel
            groups without ``strategy="fsdp2"``; the model has no ``tensor_parallel_plan``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    check_int("tp", tp, minimum=1)
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    plan = getattr(model, "tensor_parallel_plan", None)
    if not callable(plan):
        raise ValueError(
            f"tp={tp} needs a model with a tensor_parallel_plan() method returning a parallelize_module plan (the "
            f"default GPT has one); {type(model).__name__} has none"
        )
    if world_size % tp or (world_size != tp and strategy != "fsdp2"):
        raise ValueError(
            f"tp={tp} on {world_size} processes: launch a multiple of {tp} processes, with strategy='fsdp2' when "
            f"there are several data-parallel groups (here strategy={strategy!r})"
        )
    logger.info(
        "fp8train: tensor parallel over groups of %d ranks (sequence parallel), %d data-parallel group(s)",
        tp, world_size // tp,
    )
    if strategy == "fsdp2":
        mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan())
        return mesh["dp"]
    parallelize_module(model, init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",)), plan())
    return None


def after_optimizer_step(model: nn.Module, strategy: str) -> None:
    """FSDP2: precompute every tensorwise FP8 weight scale for the next all-gather (one
    batched all-reduce)."""
    if strategy == "fsdp2":
        precompute_fp8_scales_for_fsdp(model)


def _sharded(model: nn.Module, strategy: str) -> bool:
    """Whether ``model``'s parameters are ``DTensor`` s (FSDP2, tensor parallelism), whose
    whole state takes a collective."""
    return strategy == "fsdp2" or any(isinstance(p, DTensor) for p in model.parameters())


def _full_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kwargs)


def full_model_state_dict(model: nn.Module, strategy: str) -> dict:
    """The whole, unsharded ``state_dict`` (a collective under FSDP2: every rank calls it)."""
    if _sharded(model, strategy):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model, options=_full_options())
    else:
        state = model.state_dict()
    return {key: _plain(value).detach().contiguous().cpu() for key, value in state.items()}


def _plain(value: torch.Tensor) -> torch.Tensor:
    return value.high_precision() if isinstance(value, Float8AllGatherWeight) else value


def load_full_model_state_dict(model: nn.Module, state: dict, strategy: str) -> None:
    """Load a whole ``state_dict`` (as saved by :func:`full_model_state_dict`)."""
    if _sharded(model, strategy):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state, options=_full_options())
    else:
        model.load_state_dict(state)


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str) -> dict:
    """The optimizer's whole state (a collective under FSDP2; ``fp8train.optim.AdamW``'s
    local rows gathered by :func:`~.local_optimizer_state.gather_local_state`)."""
    if _sharded(model, strategy) and holds_local_state(optimizer):
        return gather_local_state(optimizer)
    if _sharded(model, strategy):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_full_options())
    return optimizer.state_dict()


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, strategy: str) -> None:
    if LOCAL_ROWS_KEY in state:
        load_local_state(optimizer, state)
    elif _sharded(model, strategy):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=_full_options())
    else:
        optimizer.load_state_dict(state)
