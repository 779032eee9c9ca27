"""The whole state of an optimizer that keeps plain tensors of each rank's rows for FSDP2's
``DTensor`` parameters (``fp8train.optim.AdamW``: masters, moments, an FP8 moment's codes
and scales), gathered for a checkpoint and cut again on load.

``torch.distributed.checkpoint``'s optimizer state dicts expect the state of a ``DTensor``
parameter to be ``DTensor`` s (they would keep rank 0's local rows as if they were the whole
tensor) and param groups of plain values (not ``torch.dtype``). Here every state tensor of a
``DTensor`` parameter (scalars such as ``step`` aside) is concatenated along dim 0 over the
ranks of the parameter's (1-D) mesh, in rank order, and the rows each rank gave are kept
beside (``LOCAL_ROWS_KEY``), so that a run on as many ranks takes its own rows back.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..nn.collective_device import collective_device

__all__ = ["LOCAL_ROWS_KEY", "holds_local_state", "gather_local_state", "load_local_state"]

LOCAL_ROWS_KEY = "local_shard_rows"
"""The entry of a gathered state dict: ``{param index: {state key: [rows of rank 0, 1, ...]}}``."""


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def holds_local_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps plain tensors of a ``DTensor`` parameter's local rows, or
    param groups ``torch.distributed.checkpoint`` cannot flatten (``torch.dtype`` values)."""
    if any(isinstance(v, torch.dtype) for group in optimizer.param_groups for v in group.values()):
        return True
    return any(
        isinstance(param, DTensor) and _local_keys(optimizer.state.get(param, {})) for param in _params(optimizer)
    )


def _local_keys(entry: dict) -> list[str]:
    """The state keys of plain, non-scalar tensors, in a fixed order (every rank alike)."""
    return sorted(k for k, v in entry.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim())


def _group_of(param: DTensor):
    mesh = param.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"the optimizer keeps local rows of a parameter on a {mesh.ndim}-D mesh (tensor parallelism with FSDP2): "
            "its whole state is gathered on a 1-D mesh only; use torch.optim.AdamW there"
        )
    return mesh.get_group(), mesh.get_local_rank()


def _gather_rows(local: torch.Tensor, group) -> tuple[torch.Tensor, list[int]]:
    """``local`` of every rank of ``group`` concatenated along dim 0, and each rank's row
    count (as bytes: gloo moves no FP8 and the rows may differ, FSDP2's uneven shards), on
    ``local``'s device; both gathers run on the group's (``collective_device``)."""
    device = collective_device(group)
    count = torch.tensor([local.shape[0]], device=device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    rows = local.contiguous().reshape(local.shape[0], math.prod(local.shape[1:])).view(torch.uint8)
    padded = torch.zeros((max(counts), rows.shape[1]), dtype=torch.uint8, device=device)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    whole = torch.cat([part[:n] for part, n in zip(parts, counts)]).to(local.device)
    return whole.view(local.dtype).reshape(sum(counts), *local.shape[1:]), counts


def gather_local_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with each ``DTensor`` parameter's local state tensors
    gathered whole (module docstring): a collective, every rank calls it (and gets it).

    Raises:
        NotImplementedError: such a parameter lives on a mesh of more than one dim.
    """
    state = optimizer.state_dict()
    gathered, rows = {}, {}
    for index, param in enumerate(_params(optimizer)):
        entry = state["state"].get(index)
        if entry is None:
            continue
        entry = dict(entry)  # the live state's dict: never write into it
        if isinstance(param, DTensor):
            group, _ = _group_of(param)
            for key in _local_keys(entry):
                entry[key], rows.setdefault(index, {})[key] = _gather_rows(entry[key], group)
        gathered[index] = entry
    return {"state": gathered, "param_groups": state["param_groups"], LOCAL_ROWS_KEY: rows}


def load_local_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a state dict :func:`gather_local_state` made: each rank takes its own rows back.

    Raises:
        ValueError: it was gathered over another number of ranks.
    """
    params = _params(optimizer)
    local = {}
    for index, entry in state["state"].items():
        entry = dict(entry)
        for key, counts in state[LOCAL_ROWS_KEY].get(index, {}).items():
            group, rank = _group_of(params[index])
            if len(counts) != dist.get_world_size(group):
                raise ValueError(
                    f"the optimizer state was saved over {len(counts)} ranks, this run shards over "
                    f"{dist.get_world_size(group)}: resume on {len(counts)} ranks"
                )
            start = sum(counts[:rank])
            entry[key] = entry[key][start : start + counts[rank]]
        local[index] = entry
    optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})
