"""``fp8train.autocast`` exited by an exception in a distributed run: no amax all-reduce on
the way out (a rank that raises must not enter a collective its peers never join), and the
delayed scales stay identical on every rank."""

import pytest
import torch
import torch.distributed as dist

import fp8train
from fp8train.spec.recipes import DelayedScaling

RECIPE = DelayedScaling(amax_history_len=4)
TIMEOUT_SECONDS = 60


def _model(small_model):
    return small_model((128, 128), "gelu", (128, 128), recipe=RECIPE, backend="emulated")


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(32, 128, generator=torch.Generator().manual_seed(10 * step + rank)) * (rank + 1)


def _rank_1_raises_before_its_forward(rank: int, results, small_model) -> None:
    model = _model(small_model)
    with fp8train.autocast():  # every module runs on every rank once
        model(_x(rank, 0))
    if rank == 1:
        try:
            with fp8train.autocast():
                raise RuntimeError("fails before the forward")
        except RuntimeError:
            pass
    # The next collective of both ranks must be this one, not an amax all-reduce of rank 1.
    total = torch.full((3,), float(rank + 1))
    dist.all_reduce(total)
    results[rank] = total.tolist()


@pytest.mark.heavy
def test_a_rank_that_raises_inside_autocast_enters_no_collective(spawn_gloo, small_model):
    results = spawn_gloo(_rank_1_raises_before_its_forward, small_model, timeout=TIMEOUT_SECONDS)
    assert results[0] == results[1] == [3.0, 3.0, 3.0]


def _every_rank_raises_after_its_forward(rank: int, results, small_model) -> None:
    model = _model(small_model)
    for step in range(3):
        try:
            with fp8train.autocast():
                model(_x(rank, step))
                if step == 1:
                    raise ValueError("a bad batch, on every rank")
        except ValueError:
            pass
    layers = [m for m in model if isinstance(m, fp8train.Float8Linear)]
    results[rank] = [(m.fp8_scale.clone(), m.fp8_amax_history.clone()) for m in layers]


@pytest.mark.slow  # the one-rank-raises case runs by default
def test_scales_stay_identical_across_ranks_when_every_rank_raises(spawn_gloo, small_model):
    results = spawn_gloo(_every_rank_raises_after_its_forward, small_model, timeout=TIMEOUT_SECONDS)
    # The ranks' inputs differ by a factor of 2: equal states mean every update was reduced
    # (a rank updating from its own amaxes on the way out of a raise would drift apart).
    for (scale_0, history_0), (scale_1, history_1) in zip(results[0], results[1]):
        assert torch.equal(scale_0, scale_1) and torch.equal(history_0, history_1)
        assert (scale_0[:2] != 1).all()  # the forward tensors were really rescaled
