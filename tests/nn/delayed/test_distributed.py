"""Delayed scaling across processes: one batched amax all-reduce per step over gloo.

Each test spawns 2 CPU processes (gloo) with the ``spawn_gloo`` fixture, which bounds them
with a timeout, so a hang fails the test instead of stalling the suite. Workers get the
``small_model`` builder as an argument (fixtures do not reach spawned processes)."""

import contextlib

import pytest
import torch
from torch import nn

import fp8train
from fp8train.spec.recipes import DelayedScaling

from ...helpers.sharded_steps import sharded_sgd_losses

WORLD_SIZE = 2
TIMEOUT_SECONDS = 120
RECIPE = DelayedScaling(amax_history_len=4)
LAYERS = ((128, 128), "gelu", (128, 128), (128, 128))


def _model(small_model) -> nn.Module:
    return small_model(*LAYERS, recipe=RECIPE, backend="emulated")


def _batches(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    # Rank-dependent magnitudes: without the reduction the ranks' scales would differ.
    x = torch.randn(2 * 32, 128, generator=generator)
    x[32:] *= 4
    return x


def _run_steps(model: nn.Module, x_for_step, steps: int, skip_last_layer_at=None, use_autocast=True) -> None:
    """``use_autocast=False``: a loop fp8train does not own (transformers' Trainer,
    accelerate): no ``fp8train.autocast``, so the end of each backward updates and reduces."""
    for step in range(steps):
        x = x_for_step(step)
        if not use_autocast and step == 1:
            model(x)  # a training forward no backward follows: the next forward settles it
        with fp8train.autocast() if use_autocast else contextlib.nullcontext():
            hidden = model[2](model[1](model[0](x)))
            out = hidden if skip_last_layer_at == step else model[3](hidden)
        # Normalised per 32-row shard on every rank and in the single process alike, so
        # grad_output values match.
        (out.square().sum() / (32 * 128)).backward()


def _worker(rank: int, results, small_model, skip_on_rank1: bool, use_autocast: bool) -> None:
    model = _model(small_model)
    skip_at = 2 if (skip_on_rank1 and rank == 1) else None
    shard = lambda step: _batches(step)[32 * rank : 32 * (rank + 1)]  # noqa: E731
    _run_steps(model, shard, steps=4, skip_last_layer_at=skip_at, use_autocast=use_autocast)
    results[rank] = [
        (m.fp8_scale.clone(), m.fp8_amax_history.clone()) for m in model if isinstance(m, fp8train.Float8Linear)
    ]


def _spawn(spawn_gloo, small_model, skip_on_rank1: bool = False, use_autocast: bool = True) -> dict:
    return spawn_gloo(_worker, small_model, skip_on_rank1, use_autocast, world_size=WORLD_SIZE, timeout=TIMEOUT_SECONDS)


def _single_process_states(small_model, skip_at=None, use_autocast=True):
    """The same steps in one process on the concatenated batch (grad_output amaxes are the
    max over both halves, as the all-reduce makes them)."""
    model = _model(small_model)
    _run_steps(model, _batches, steps=4, skip_last_layer_at=skip_at, use_autocast=use_autocast)
    return [(m.fp8_scale, m.fp8_amax_history) for m in model if isinstance(m, fp8train.Float8Linear)]


@pytest.mark.heavy
# With autocast under -m slow: by default test_ddp_matches_one_process_on_the_global_batch
# runs delayed scaling's autocast reduction (its losses equal one process's).
@pytest.mark.parametrize(
    "use_autocast", [pytest.param(True, marks=pytest.mark.slow), False], ids=["autocast", "any_loop"]
)
def test_delayed_scales_identical_on_both_ranks_and_equal_to_one_process(spawn_gloo, small_model, use_autocast):
    results = _spawn(spawn_gloo, small_model, use_autocast=use_autocast)
    reference = _single_process_states(small_model, use_autocast=use_autocast)
    for layer, (scale_0, history_0) in enumerate(results[0]):
        scale_1, history_1 = results[1][layer]
        assert torch.equal(scale_0, scale_1), layer
        assert torch.equal(history_0, history_1), layer
        # The all-reduced amaxes are the single process's amaxes over the whole batch.
        ref_scale, ref_history = reference[layer]
        assert torch.equal(scale_0, ref_scale), layer
        assert torch.equal(history_0, ref_history), layer
        assert (scale_0 != 1).all(), layer  # every tensor was really rescaled


# Without autocast by default (the newer path, through the end of the backward); with
# autocast under -m slow (the same registry and all-reduce, at the autocast's exit).
@pytest.mark.heavy  # multi-process: moved out of the README's command to keep it under 6 minutes (CI's second leg runs it)
@pytest.mark.parametrize(
    "use_autocast", [pytest.param(True, marks=pytest.mark.slow), False], ids=["autocast", "any_loop"]
)
def test_a_module_skipped_on_one_rank_does_not_hang_and_stays_in_sync(spawn_gloo, small_model, use_autocast):
    results = _spawn(spawn_gloo, small_model, skip_on_rank1=True, use_autocast=use_autocast)
    for layer, (scale_0, history_0) in enumerate(results[0]):
        scale_1, history_1 = results[1][layer]
        assert torch.equal(scale_0, scale_1), layer
        assert torch.equal(history_0, history_1), layer


# ---------------------------------------------------------------------------------- DDP
DDP_STEPS = 4
# Loss per step, DDP (2 x 32 rows) vs one process (64 rows). delayed: the same scales and
# FP8 codes, only float32 summation order differs. tensorwise: each rank scales its own
# shard (current scaling), so quantization differs a little.
DDP_LOSS_RTOL = {
    "delayed": 1e-5,
    "tensorwise": 2e-2,
    "rowwise": 1e-5,
    "rowwise_with_gw_hp": 1e-5,
    "blockwise": 1e-5,
    "mxfp8": 1e-5,
}
DDP_LAYERS = ((128, 256), "gelu", (256, 128))


def _ddp_model(small_model, recipe: str) -> nn.Module:
    return small_model(*DDP_LAYERS, recipe=recipe, backend="emulated")


def _ddp_losses(model: nn.Module, shard, world: int) -> list[float]:
    """SGD steps on ``shard`` of each batch (:func:`tests.helpers.sharded_steps.sharded_sgd_losses`)."""
    batches = (_batches(step) for step in range(DDP_STEPS))
    return sharded_sgd_losses(model, batches, shard, 32 * 128, world, WORLD_SIZE)


def _ddp_worker(rank: int, results, small_model, recipe: str) -> None:
    model = nn.parallel.DistributedDataParallel(_ddp_model(small_model, recipe))
    losses = _ddp_losses(model, lambda x: x[32 * rank : 32 * (rank + 1)], WORLD_SIZE)
    grad_dtypes = {p.dtype for p in model.parameters()}
    results[rank] = (losses, [p.detach().clone() for p in model.module.parameters()], grad_dtypes)


@pytest.mark.heavy
# Two recipes by default (delayed: reduced state; mxfp8: block scales); the rest under -m slow.
@pytest.mark.parametrize(
    "recipe", [r if r == "delayed" else pytest.param(r, marks=pytest.mark.slow) for r in DDP_LOSS_RTOL]
)
def test_ddp_matches_one_process_on_the_global_batch(recipe, spawn_gloo, small_model):
    results = spawn_gloo(_ddp_worker, small_model, recipe, world_size=WORLD_SIZE, timeout=TIMEOUT_SECONDS)
    reference = _ddp_losses(_ddp_model(small_model, recipe), lambda x: x, 1)
    losses_0, params_0, dtypes = results[0]
    losses_1, params_1, _ = results[1]
    assert losses_0 == losses_1
    assert dtypes == {torch.float32}  # gradients all-reduced in the parameters' own dtype
    torch.testing.assert_close(torch.tensor(losses_0), torch.tensor(reference), rtol=DDP_LOSS_RTOL[recipe], atol=0)
    for p0, p1 in zip(params_0, params_1):
        assert torch.equal(p0, p1)  # DDP keeps the replicas identical
