"""SGD steps of a model on its rank's shard of each batch, for the tests that compare a
data-parallel run (DDP, FSDP2) with one process on the whole batch."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

import fp8train


def sharded_sgd_losses(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    shard: Callable[[torch.Tensor], torch.Tensor],
    normaliser: float,
    world: int,
    world_size: int,
    after_step: Callable[[nn.Module], None] | None = None,
    use_autocast: bool = True,
) -> list[float]:
    """One SGD step per batch on ``shard(batch)`` with the loss ``sum(out**2) / normaliser``.

    The normaliser counts one shard's elements everywhere, so every rank's grad_output
    equals the one-process grad_output row for row (delayed scaling's first step
    quantizes with scale 1, where a factor of 2 would change the FP8 codes). Data
    parallelism averages the ``world_size`` shards' gradients where one process
    (``world=1``) sums them, so the learning rate is ``0.1 * world / world_size``.
    ``after_step(model)`` runs after each optimizer step. ``use_autocast=False`` runs the
    forward outside ``fp8train.autocast``, as a loop fp8train does not own. Returns each
    step's loss, the mean over ranks where ``world > 1``.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * world / world_size)
    losses = []
    for batch in batches:
        with fp8train.autocast() if use_autocast else contextlib.nullcontext():
            loss = model(shard(batch)).square().sum() / normaliser
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(model)
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
        losses.append(reported.item() / world_size)
    return losses
