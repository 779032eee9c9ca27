"""A NaN on one rank survives every MAX reduction of amaxes, as it does in one process.

nccl's MAX reduces floats with ``fmaxf``, which drops a NaN unless every rank has one;
gloo's keeps or drops it by rank order. fp8train's reductions must give what one process
gives on the whole tensor: delayed scaling keeps its scale after a NaN amax, and a sharded
weight's per-tensor scale is a NaN amax's. Two gloo ranks, the NaN on either of them, each
reduction run twice: through gloo's MAX, and through an ``fmaxf`` MAX (every rank's values
gathered and folded with ``torch.fmax``, as nccl's kernel folds them) standing in for
nccl's. One spawn serves every case."""

from __future__ import annotations

import contextlib
import functools
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8train
from fp8train.nn.delayed.amax import all_reduce_max
from fp8train.parallel.gather import gather_plan, per_tensor_scales
from fp8train.spec import Role
from fp8train.spec.recipes import DelayedScaling, from_name

WORLD_SIZE = 2
ROWS = 16  # per rank
REDUCTIONS = ("gloo", "fmaxf")
DELAYED = DelayedScaling(amax_history_len=4)
AMAXES = ([1.0, 7.0, 0.5], [3.0, 2.0, 9.0])  # per rank: which rank holds each column's MAX varies


def _whole(nan_rank: int) -> torch.Tensor:
    """The whole tensor, ``ROWS`` rows per rank, a NaN in ``nan_rank``'s rows."""
    x = torch.randn(WORLD_SIZE * ROWS, 32, generator=torch.Generator().manual_seed(5))
    x[nan_rank * ROWS + 3, 4] = math.nan
    return x


def _delayed_model() -> nn.Module:
    torch.manual_seed(0)
    return fp8train.convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), DELAYED, backend="emulated")


def _delayed_state(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A training forward under ``fp8train.autocast`` (its exit reduces the amaxes and
    updates the scales), then the layer's scales and amax history."""
    model = _delayed_model()
    with fp8train.autocast():
        model(x)
    return model[0].fp8_scale.clone(), model[0].fp8_amax_history.clone()


def _amaxes(rank: int, nan_rank: int) -> list[torch.Tensor]:
    first = torch.tensor(AMAXES[rank][:2])
    if rank == nan_rank:
        first[1] = math.nan
    return [first, torch.tensor(AMAXES[rank][2:])]


def _fmaxf_all_reduce(real_all_reduce, real_all_gather, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``dist.all_reduce`` whose MAX folds the ranks' values with ``fmax`` (NaN dropped
    unless every rank has one), as nccl's does; any other op is gloo's own."""
    if op != dist.ReduceOp.MAX:
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    real_all_gather(parts, tensor, group=group)
    tensor.copy_(functools.reduce(torch.fmax, parts))


def _reduction(name: str):
    if name == "gloo":
        return contextlib.nullcontext()
    fmaxf = functools.partial(_fmaxf_all_reduce, dist.all_reduce, dist.all_gather)
    return mock.patch.object(dist, "all_reduce", fmaxf)


def _worker(rank: int, results) -> None:
    gather = gather_plan(from_name("tensorwise"), Role.WEIGHT)
    for nan_rank in range(WORLD_SIZE):
        shard = _whole(nan_rank)[rank * ROWS : (rank + 1) * ROWS]
        for reduction in REDUCTIONS:
            with _reduction(reduction):
                amaxes = _amaxes(rank, nan_rank)
                all_reduce_max(amaxes, None)
                scale = per_tensor_scales([shard], [gather], None)[0]
                delayed = _delayed_state(shard)
            results[rank, nan_rank, reduction] = {"amaxes": amaxes, "per_tensor_scale": scale, "delayed": delayed}


@pytest.fixture(scope="module")
def reduced(spawn_gloo) -> dict:
    return spawn_gloo(_worker, world_size=WORLD_SIZE)


def _one_process(case: str, nan_rank: int):
    """What one process gives on the whole tensor."""
    if case == "amaxes":
        ranks = [torch.cat(_amaxes(rank, nan_rank)) for rank in range(WORLD_SIZE)]
        whole = functools.reduce(torch.maximum, ranks)  # torch.maximum propagates NaN
        return [whole[:2], whole[2:]]
    if case == "per_tensor_scale":
        return per_tensor_scales([_whole(nan_rank)], [gather_plan(from_name("tensorwise"), Role.WEIGHT)], None)[0]
    return _delayed_state(_whole(nan_rank))


@pytest.mark.heavy  # multi-process: moved out of the README's command to keep it under 6 minutes (CI's second leg runs it)
@pytest.mark.parametrize("case", ["amaxes", "per_tensor_scale", "delayed"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("nan_rank", range(WORLD_SIZE))
def test_a_nan_on_one_rank_reduces_as_in_one_process(reduced, case, reduction, nan_rank):
    expected = _one_process(case, nan_rank)
    for rank in range(WORLD_SIZE):
        torch.testing.assert_close(reduced[rank, nan_rank, reduction][case], expected, rtol=0, atol=0, equal_nan=True)


def test_one_process_keeps_the_delayed_scale_after_a_nan_amax():
    """The semantics the ranks must reproduce: the input's NaN amax rolls into the history
    and its scale stays where it was (1 before any update); the weight's is updated."""
    scale, history = _delayed_state(_whole(0))
    column = Role.INPUT.index
    assert scale[column] == 1 and history[-1, column].isnan() and not history[:-1, column].isnan().any()
    assert scale[Role.WEIGHT.index] != 1
