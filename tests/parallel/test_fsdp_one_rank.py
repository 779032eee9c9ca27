"""FSDP2 over one rank (``torchrun --nproc-per-node 1``, a one-GPU machine): FSDP2 skips
the all-gather of a world of one and copies only each parameter's first all-gather input,
so a weight gathered as several (FP8 data, block scales, a columnwise copy) lost the rest
(IndexError in the post-all-gather). fp8train packs them into one buffer there; training
must equal one process without FSDP2, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch import nn

import fp8train
from fp8train.parallel import Float8AllGatherWeight, enable_fp8_all_gather
from fp8train.parallel.fp8_weight_shard import Float8WeightShard

from ..helpers.sharded_steps import sharded_sgd_losses
from .test_fsdp_fp8_weights import STEPS, _reference, _sharded, _steps

# Block scales (blockwise, mxfp8, mxfp4), a columnwise copy of its own (mxfp8, mxfp4), and
# one per-tensor recipe whose single input FSDP2 always copied.
RECIPES = ["blockwise", "mxfp8", "mxfp4", "tensorwise"]


@pytest.fixture
def one_rank_mesh(one_rank_group):
    return init_device_mesh("cpu", (1,))


def _model(small_model, recipe: str) -> nn.Module:
    return small_model((128, 256), "gelu", (256, 128), recipe=recipe, backend="emulated")


def _losses(model: nn.Module) -> list[float]:
    batches = [torch.randn(64, 128, generator=torch.Generator().manual_seed(step)) for step in range(STEPS)]
    return sharded_sgd_losses(model, batches, lambda x: x, 64 * 128, 1, 1)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_all_gather_over_one_rank_trains_as_one_process(recipe, small_model, one_rank_mesh):
    sharded = enable_fp8_all_gather(_model(small_model, recipe))
    assert all(isinstance(layer.weight, Float8AllGatherWeight) for layer in sharded if isinstance(layer, nn.Linear))
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=one_rank_mesh)
    fully_shard(sharded, mesh=one_rank_mesh)
    assert _losses(sharded) == _losses(_model(small_model, recipe))


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_fp8_weights_over_one_rank_train_as_one_process(recipe, one_rank_mesh):
    gathered = []
    original = Float8WeightShard.fsdp_post_all_gather

    def spy(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        gathered.append(len(all_gather_outputs))
        return original(self, all_gather_outputs, metadata, param_dtype, out=out)

    expected = _reference(recipe)
    Float8WeightShard.fsdp_post_all_gather = spy
    try:
        model, optimizer = _sharded(recipe, one_rank_mesh)
        losses = _steps(model, optimizer, range(STEPS))
    finally:
        Float8WeightShard.fsdp_post_all_gather = original
    assert gathered and set(gathered) == {1}, "a world of one gathers one packed buffer per weight"
    assert losses == expected["losses"]
    masters = [optimizer.state[w]["master"] for w in (model[0].weight, model[2].weight)]
    assert all(torch.equal(a, b) for a, b in zip(masters, expected["masters"], strict=True))
