"""FSDP2 x tensor parallel on a 2-D mesh (dp=2, tp=2: 4 CPU processes over gloo): the
default model trains with its weights all-gathered in FP8 over ``dp`` and its activations
over ``tp``, with the losses of one process on the whole batch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import fp8train
from fp8train.parallel import Float8AllGatherWeight, enable_fp8_all_gather, precompute_fp8_scales_for_fsdp
from fp8train.train.model import GPT, GPTConfig

DP, TP = 2, 2
TIMEOUT_SECONDS = 300
STEPS, BATCH, SEQ = 3, 4, 64
# Loss per step against one process. mxfp8: the same codes and scales everywhere (weight
# blocks whole per shard, activation gathers bit-equal), only float32 summation order
# differs. tensorwise: each tensor-parallel rank scales its own weight slice. mxfp4: as
# mxfp8, in 4 bits (measured 2e-7). nvfp4: weights gathered over dp under the slice's
# global amax, activations gathered over tp under the whole tensor's, bit-equal; but each
# tensor-parallel slice and data-parallel batch shard has its own global amax, and each
# rank its own stochastic rounding draws (measured 1.6e-3).
LOSS_RTOL = {"mxfp8": 1e-5, "tensorwise": 1e-2, "mxfp4": 1e-5, "nvfp4": 5e-3}


def _model(recipe: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=128, block_size=SEQ))
    return fp8train.convert_to_float8_training(model, recipe, backend="emulated")


def _train(model: GPT, shard, dp_group=None) -> list[float]:
    """AdamW steps on a fixed batch stream; each data-parallel rank takes its half."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        idx, targets = (torch.randint(0, 256, (BATCH, SEQ), generator=generator) for _ in range(2))
        with fp8train.autocast():
            loss = model(shard(idx), shard(targets))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        if dp_group is not None:
            precompute_fp8_scales_for_fsdp(model, dp_group)
            dist.all_reduce(reported, group=dp_group)
        losses.append(reported.item() / (DP if dp_group is not None else 1))
    return losses


def _worker(rank: int, results, recipe: str) -> None:
    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = _model(recipe)
    parallelize_module(model, mesh["tp"], model.tensor_parallel_plan())
    enable_fp8_all_gather(model, shard_world_size=DP)
    wrapped = [
        isinstance(p.to_local() if isinstance(p, DTensor) else p, Float8AllGatherWeight)
        for name, p in model.named_parameters()
        if name.endswith(("qkv.weight", "proj.weight", "fc.weight", "lm_head.weight"))
    ]
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    losses = _train(model, lambda t: t.chunk(DP)[dp_rank], mesh["dp"].get_group())
    # Sharded over both mesh dims: dp (FSDP2) and tp (the style's Shard(dim)).
    placements = {
        name: (len(p.placements), p.placements[1].dim)
        for name, p in model.named_parameters()
        if name.startswith("blocks.0.fc") and name.endswith("weight")
    }
    results[rank] = {"losses": losses, "wrapped": wrapped, "placements": placements}


def _check_2d_run(spawn_gloo, recipe: str) -> None:
    results = spawn_gloo(_worker, recipe, world_size=DP * TP, timeout=TIMEOUT_SECONDS)
    reference = _train(_model(recipe), lambda t: t)
    for rank in range(DP * TP):
        assert results[rank]["losses"] == results[0]["losses"]
    torch.testing.assert_close(
        torch.tensor(results[0]["losses"]), torch.tensor(reference), rtol=LOSS_RTOL[recipe], atol=0
    )
    assert results[0]["wrapped"] == [True] * 5  # qkv, proj, fc, fc_proj, lm_head: FP8 weight gathers over dp
    placements = results[0]["placements"]
    assert placements["blocks.0.fc.weight"] == (2, 0)  # column parallel
    assert placements["blocks.0.fc_proj.weight"] == (2, 1)  # row parallel


@pytest.mark.slow  # 2-D mesh; 1-D tensor parallel runs by default (test_tensor_parallel*.py)
def test_fsdp2_times_tensor_parallel_trains_like_one_process(spawn_gloo):
    _check_2d_run(spawn_gloo, "mxfp8")


@pytest.mark.slow
def test_fsdp2_times_tensor_parallel_tensorwise(spawn_gloo):
    _check_2d_run(spawn_gloo, "tensorwise")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4"])
def test_fsdp2_times_tensor_parallel_4bit(spawn_gloo, recipe):
    _check_2d_run(spawn_gloo, recipe)
