"""Sequence parallelism with the 4-bit recipes, on 2 CPU processes over gloo: the 4-bit
all-gather of sequence-sharded inputs and grad_outputs (packed E2M1 codes and block
scales; NVFP4 under the global amax all-reduced MAX over the tensor-parallel group,
per usage) against quantizing the whole tensor in one process, and (``-m slow``) the
transformer block of test_tensor_parallel.py with TP=2 against one process."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from fp8train.parallel import gather_plan
from fp8train.parallel.gather import global_amaxes
from fp8train.parallel.sequence_gather import activation_gather_plan, all_gather_fp8
from fp8train.quant.quantize import quantize
from fp8train.spec import NVFP4Scaling, Role
from fp8train.spec.recipes import from_name

from .test_tensor_parallel import (
    OUTLIER,
    _bits,
    _block,
    _full,
    _full_tensor,
    _recording_gathers,
    _relative_error,
    _run_block,
    tp_plan,
)

WORLD_SIZE = 2
TIMEOUT_SECONDS = 300
# nvfp4_rne: without stochastic rounding, so that grad_output's codes are one process's too.
RECIPES = {
    "nvfp4": from_name("nvfp4"),
    "mxfp4": from_name("mxfp4"),
    "nvfp4_rne": NVFP4Scaling(disable_stochastic_rounding=True),
}
# Transformer block vs one process: (output, every gradient), relative Frobenius error.
# mxfp4: groups local to a rank everywhere, gathered operands bit-equal: measured 0.
# NVFP4: the gathered operands are one process's, but each rank quantizes its weight
# slice and its feature-sharded operands (a row-parallel layer's input, a column-parallel
# layer's grad_output) under their own global amax, as Transformer Engine does: another
# 4-bit quantization of those tensors (measured: output 0.021, gradients 0.13), and with
# stochastic rounding its own draws (gradients 0.23: as far apart as two seeds of one
# process, 0.23 on this block).
BLOCK_RTOL = {"mxfp4": (1e-5, 1e-5), "nvfp4_rne": (0.05, 0.2), "nvfp4": (0.05, 0.35)}


def _gather_record(recipe, role: Role, x: torch.Tensor, rank: int, moved: list) -> dict:
    """Gather rank's half of ``x`` (along the token dim 1) and compare with one process."""
    shard = x.chunk(WORLD_SIZE, dim=1)[rank]
    gather, reason = activation_gather_plan(recipe, role, tuple(shard.shape), 1, WORLD_SIZE)
    assert gather is not None, reason
    del moved[:]
    gathered = all_gather_fp8(shard, gather, 1, dist.group.WORLD)
    rowwise = quantize(x, gather.rowwise.rule, axis=-1)
    columnwise = quantize(x, gather.columnwise.rule, axis=0)
    got_rowwise, got_columnwise = gathered.fp8_rowwise, gathered.fp8_columnwise
    return {
        "shape": tuple(gathered.shape),
        "data": torch.equal(_bits(got_rowwise.data), _bits(rowwise.data)),
        "scales": torch.equal(_bits(got_rowwise.scale_inv), _bits(rowwise.scale_inv)),
        "columnwise_data": torch.equal(_bits(got_columnwise.data), _bits(columnwise.data.t())),
        "columnwise_scales": torch.equal(_bits(got_columnwise.scale_inv), _bits(columnwise.scale_inv.t())),
        "global_amax": [None if q.global_amax is None else q.global_amax.item() for q in (got_rowwise, got_columnwise)],
        "expected_global_amax": [None if q.global_amax is None else q.global_amax.item() for q in (rowwise, columnwise)],
        "moved": list(moved),
    }


def _gather_worker(rank: int, results) -> None:
    warnings.filterwarnings("ignore")
    out = {}
    with _recording_gathers() as moved:
        for name in RECIPES:
            for role in (Role.INPUT, Role.GRAD_OUTPUT):
                out[name, role.value] = _gather_record(RECIPES[name], role, _full_tensor(role), rank, moved)
    # A NaN on rank 1 only: every rank's global amaxes must be NaN, as one process's would be.
    shard = torch.ones(32, 64)
    if rank == 1:
        shard[3, 5] = float("nan")
    (rowwise, columnwise), = global_amaxes([shard], [gather_plan(RECIPES["nvfp4"], Role.INPUT)], dist.group.WORLD)
    out["nan"] = [rowwise.isnan().item(), columnwise.isnan().item()]
    results[rank] = out


def _block_worker(rank: int, results) -> None:
    warnings.filterwarnings("ignore")
    out = {}
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    with _recording_gathers() as moved:
        for name in BLOCK_RTOL:
            block = parallelize_module(_block(RECIPES[name]), mesh, tp_plan())
            del moved[:]
            torch.manual_seed(rank)  # each rank its own stochastic rounding draws
            y, grads = _run_block(block, lambda x: x.chunk(WORLD_SIZE, dim=1)[rank])
            out[name] = {"output": y, "grads": {k: _full(g) for k, g in grads.items()}, "moved": list(moved)}
    results[rank] = out


@pytest.fixture(scope="module")
def runs(spawn_gloo):
    return spawn_gloo(_gather_worker, world_size=WORLD_SIZE, timeout=TIMEOUT_SECONDS)


@pytest.fixture(scope="module")
def block_runs(spawn_gloo):
    return spawn_gloo(_block_worker, world_size=WORLD_SIZE, timeout=TIMEOUT_SECONDS)


@pytest.mark.heavy  # multi-process: moved out of the README's command to keep it under 6 minutes (CI's second leg runs it)
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("role", ["input", "grad_output"])
def test_4bit_all_gather_is_bit_equal_to_quantizing_the_whole_tensor(runs, name, role):
    stochastic = name == "nvfp4" and role == "grad_output"  # each rank draws its own rounding
    for rank in range(WORLD_SIZE):
        record = runs[rank][name, role]
        assert record["shape"] == (2, 256, 256)
        assert record["scales"] and record["columnwise_scales"], record
        assert (record["data"] and record["columnwise_data"]) or stochastic, record
        # NVFP4: both usages under the whole tensor's global amax (the columnwise one of the
        # transformed tensor), though rank 0's shard lacks the outlier.
        assert record["global_amax"] == record["expected_global_amax"]
    if name != "mxfp4":
        assert runs[0][name, "input"]["global_amax"][0] == OUTLIER


@pytest.mark.heavy  # multi-process: moved out of the README's command to keep it under 6 minutes (CI's second leg runs it)
def test_a_nan_on_one_rank_makes_every_ranks_global_amax_nan(runs):
    assert runs[0]["nan"] == runs[1]["nan"] == [True, True]


@pytest.mark.heavy  # multi-process: moved out of the README's command to keep it under 6 minutes (CI's second leg runs it)
@pytest.mark.parametrize("name", list(RECIPES))
def test_4bit_all_gather_moves_half_a_byte_per_value_and_its_scales(runs, name):
    block = gather_plan(RECIPES[name], Role.INPUT).rowwise.granularity.block
    for role in ("input", "grad_output"):
        (dtype, num_bytes), = runs[0][name, role]["moved"]  # one collective
        shard_numel = 2 * 128 * 256
        codes = 2 * shard_numel // 2  # rowwise and columnwise codes, two a byte
        assert dtype == torch.uint8
        assert num_bytes == codes + 2 * shard_numel // block


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BLOCK_RTOL))
def test_sequence_parallel_4bit_block_matches_one_process(block_runs, name):
    torch.manual_seed(0)
    y_ref, grads_ref = _run_block(_block(RECIPES[name]), lambda x: x)
    y = torch.cat([block_runs[rank][name]["output"] for rank in range(WORLD_SIZE)], dim=1)
    output_rtol, grad_rtol = BLOCK_RTOL[name]
    assert _relative_error(y_ref, y) < output_rtol
    grads = block_runs[0][name]["grads"]
    assert set(grads) == set(grads_ref)
    for key, grad_ref in grads_ref.items():
        assert _relative_error(grad_ref, grads[key]) < grad_rtol, key
        torch.testing.assert_close(block_runs[1][name]["grads"][key], grads[key])
    # Attention's input, w1's input and the grad_outputs of wo and w2, per step, in 4 bits.
    assert len(block_runs[0][name]["moved"]) == 2 * 4
