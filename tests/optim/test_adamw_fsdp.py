"""fp8train.optim.AdamW over FSDP2's DTensor parameters: each rank updates its local shard
(AdamW is elementwise). One rank in this process (an in-memory store, no ports), and two
spawned gloo ranks (slow): the sharded model's weights after a few steps equal an unsharded
model's bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fp8train.optim import AdamW

SETTINGS = dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.bfloat16, stochastic_rounding=False)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _train_both(models, optimizers, steps: int = 3) -> None:
    """The same ``steps`` steps, on the same batches, for each model with its optimizer."""
    for step in range(steps):
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for model, optimizer in zip(models, optimizers):
            model(inputs).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()


def test_fsdp2_sharded_parameters_step_like_plain_ones(one_rank_group):
    sharded = fully_shard(_model(), mesh=init_device_mesh("cpu", (1,)))
    plain = _model()
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    optimizers = [AdamW(m.parameters(), lr=1e-2, **SETTINGS) for m in (sharded, plain)]
    _train_both((sharded, plain), optimizers)
    for mine, theirs in zip(sharded.parameters(), plain.parameters()):
        assert torch.equal(mine.full_tensor(), theirs)
    state = optimizers[0].state[next(sharded.parameters())]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn and not isinstance(state["exp_avg"], DTensor)


# Elementwise storage only: an FP8 moment's blocks are blocks of the local shard, so its
# roundings differ from an unsharded model's (by design, not by error).
ELEMENTWISE = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, stochastic_rounding=False)


def _two_rank_worker(rank: int, results) -> None:
    sharded = fully_shard(_model(), mesh=init_device_mesh("cpu", (2,)))
    plain = _model()
    optimizers = [AdamW(m.parameters(), lr=1e-2, **ELEMENTWISE) for m in (sharded, plain)]
    _train_both((sharded, plain), optimizers)  # the same batches on both ranks: the unsharded gradient
    results[rank] = all(torch.equal(a.full_tensor(), b) for a, b in zip(sharded.parameters(), plain.parameters()))


@pytest.mark.slow
def test_fsdp2_two_ranks_step_like_one_unsharded_model(spawn_gloo):
    assert spawn_gloo(_two_rank_worker) == {0: True, 1: True}
