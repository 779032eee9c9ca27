"""Process groups, model wrapping (DDP or FSDP2) and full-state checkpoints for the trainer.

Launch with ``torchrun``: ``init_distributed`` reads its environment (``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``) and starts ``gloo`` on CPU or ``nccl`` on CUDA, with a timeout
on every collective. ``report_rank_failures`` turns the backend's error when a peer
fails into a :class:`RankFailedError` that names the rank that failed.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..nn.linear import Float8Linear
from ..spec.checks import check_int, check_number
from .fsdp import Float8AllGatherWeight, enable_fp8_all_gather, precompute_fp8_scales_for_fsdp
from .local_optimizer_state import LOCAL_ROWS_KEY, gather_local_state, holds_local_state, load_local_state

__all__ = [
    "STRATEGIES",
    "DEFAULT_TIMEOUT_SECONDS",
    "RankFailedError",
    "init_distributed",
    "close_distributed",
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


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> tuple[int, int]:
    """Start the default process group under ``torchrun`` (no-op otherwise).

    Args:
        device: ``cuda`` starts ``nccl``, anything else ``gloo``.
        timeout_seconds: how long a collective (and the start-up rendezvous) waits for a
            rank that does not join before it fails (gloo raises; nccl's watchdog ends the
            process). A group started elsewhere keeps its own timeout.

    Returns:
        ``(rank, world_size)``.

    Raises:
        TypeError: ``timeout_seconds`` is not a number.
        ValueError: ``timeout_seconds`` is not finite and > 0.
    """
    check_number("timeout_seconds", timeout_seconds, minimum=0, exclusive=True, kind="a finite number of seconds")
    if world_size_from_env() > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_seconds)
        )
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def close_distributed() -> None:
    """End the process group :func:`init_distributed` started, once every rank is done
    (a barrier first). A gloo group left to interpreter exit can abort the process there
    ("terminate called without an active exception") after a successful run."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_main_process() -> bool:
    """Rank 0, or the only process."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# ---------------------------------------------------------------------------- rank failures

_FAILURES_KEY = "fp8train/failed_ranks"  # lines "<rank>\t<error>", appended by each rank that raises
_STORE_TIMEOUT = datetime.timedelta(seconds=5)  # a store lookup never holds a failing run up for long
_MAX_SUMMARY = 500
# What gloo raises (a plain RuntimeError) when a peer's connection closes or a collective times out.
_GLOO_COLLECTIVE_FAILURE = re.compile(r"gloo/transport|Connection (closed|reset) by peer|Timed out waiting")
_TIMED_OUT = re.compile(r"tim(ed|ing)\s?out|timeout", re.IGNORECASE)


class RankFailedError(RuntimeError):
    """A collective could not finish because another rank raised, exited, was killed, or did
    not join it within the process group's timeout (``--dist_timeout``).

    Attributes:
        rank: the rank that raised this.
        failed_ranks: the ranks that failed, as far as this rank can tell; empty when it
            cannot (then the other ranks' logs, or torchrun's "Root Cause", say).
    """

    def __init__(self, message: str, rank: int = -1, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank, self.failed_ranks = rank, tuple(failed_ranks)

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.failed_ranks)


@contextlib.contextmanager
def report_rank_failures(timeout_seconds: float | None = None) -> Iterator[None]:
    """Around code that runs collectives on the default process group: when one fails
    because of another rank, raise an error that names that rank.

    A rank whose code raises inside the block first records its error in the store of the
    ``env://`` rendezvous (``MASTER_ADDR:MASTER_PORT``: rank 0's, or torchrun's agent's),
    then lets it propagate unchanged; when its process exits, its connections close and
    the ranks waiting for it in a collective fail at once. Each of those raises
    :class:`RankFailedError` naming the rank from its record; without a record (a rank
    that was killed, or that hangs and so fails the collective after the group's timeout)
    it names the other rank of a two-rank group, else points at the other ranks' logs.
    A no-op without a process group of more than one rank.

    Args:
        timeout_seconds: the group's collective timeout, quoted in the messages.

    Raises:
        RankFailedError: a collective failed because of another rank; the backend's own
            error is its ``__cause__``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = _connect_failure_store()
    try:
        yield
    except RankFailedError:
        raise
    except BaseException as error:
        if not _is_collective_failure(error):
            _record_failure(store, rank, error)
            raise
        reports = _read_failures(store)
        raise _rank_failed_error(error, rank, world_size, reports, timeout_seconds) from error


def _is_collective_failure(error: BaseException) -> bool:
    """The backend's error for a collective that a peer broke off or never joined (nccl and
    the store raise ``DistError``s; gloo a ``RuntimeError`` from its transport)."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and _GLOO_COLLECTIVE_FAILURE.search(str(error)) is not None


def _connect_failure_store() -> dist.Store | None:
    """A client of the rendezvous store, or None (not ``env://``, or unreachable)."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not address or not port.isdigit():
        return None
    try:
        store = dist.TCPStore(address, int(port), is_master=False, timeout=_STORE_TIMEOUT)
    except RuntimeError as error:  # DistNetworkError, DistStoreError
        logger.debug("rank failures will not be named: no store at %s:%s (%s)", address, port, error)
        return None
    return store


def _record_failure(store: dist.Store | None, rank: int, error: BaseException) -> None:
    if store is None:
        return
    summary = " ".join(f"{type(error).__name__}: {error}".split()).rstrip(" :")[:_MAX_SUMMARY]
    try:
        store.append(_FAILURES_KEY, f"{rank}\t{summary}\n")
    except RuntimeError as store_error:  # the store's host is gone: the peers fall back
        logger.debug("could not record rank %d's failure in the store: %s", rank, store_error)


def _read_failures(store: dist.Store | None) -> dict[int, str]:
    """``{rank: error summary}`` of the ranks that recorded a failure (first record wins)."""
    if store is None:
        return {}
    try:
        if not store.check([_FAILURES_KEY]):
            return {}
        text = store.get(_FAILURES_KEY).decode(errors="replace")
    except RuntimeError:  # the store's host was the rank that failed
        return {}
    reports: dict[int, str] = {}
    for line in text.splitlines():
        rank_text, _, summary = line.partition("\t")
        if rank_text.isdigit():
            reports.setdefault(int(rank_text), summary)
    return reports


def _rank_failed_error(
    error: BaseException, rank: int, world_size: int, reports: dict[int, str], timeout_seconds: float | None
) -> RankFailedError:
    backend = (str(error).strip().splitlines() or [type(error).__name__])[0]
    timeout = f"--dist_timeout={timeout_seconds:g} s" if timeout_seconds else "the process group's timeout"
    peers = [r for r in range(world_size) if r != rank]
    if reports:
        failed = tuple(sorted(reports))
        causes = "; ".join(f"rank {r} failed with {reports[r]}" for r in failed)
        message = f"rank {rank}: a collective failed because {causes} (its traceback is in the log of {_ranks(failed)})"
    else:
        failed = tuple(peers) if len(peers) == 1 else ()
        who = f"rank {peers[0]}" if failed else "another rank"
        if _TIMED_OUT.search(str(error)):
            message = (
                f"rank {rank}: {who} did not join a collective within {timeout}: it is stuck, or in a "
                "different collective (raise --dist_timeout if it is only slow)"
            )
        else:
            message = (
                f"rank {rank}: a collective failed because {who} exited or was killed without recording an "
                "error (a signal, out of memory, a crash in native code, or its record was in its own store)"
            )
        logs = f"the log of {who}" if failed else "the other ranks' logs"
        message += f"; see {logs}, or the 'Root Cause' in torchrun's report"
    return RankFailedError(f"{message}\nbackend error: {backend}", rank, failed)


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def resolve_strategy(strategy: str, world_size: int, tp: int = 1) -> str:
    """``auto``: DDP with more than one process, else none (with tensor parallelism over
    ``tp`` ranks: FSDP2 over the data-parallel groups, none when there is one); the others
    as named (``ddp`` and ``fsdp2`` also run in a single process).

    Raises:
        ValueError: an unknown strategy; ``ddp`` with ``tp`` > 1.
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
        for unit in _fsdp_units(model):
            fully_shard(unit, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


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
