"""A training step of every recipe synchronizes nothing on a GPU: after a warm-up step,
the next forward, backward and delayed update (at ``fp8train.autocast``'s exit) build no
tensor from Python data, read no device value on the host and copy nothing between
devices (tests/helpers/host_syncs.py). On the reference path, which a GPU takes; the CPU numba
kernels go through NumPy by design."""

import pytest
import torch

import fp8train
from fp8train.nn.modules.routing import ExpertRoutes
from fp8train.quant.kernels import use_quant_settings
from fp8train.spec.recipes import RECIPE_NAMES

from ..helpers.host_syncs import HOST_READ, HostSyncRecorder, assert_no_host_syncs

LAYERS = ((128, 128), "gelu", (128, 128))  # blockwise converts multiples of 128


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    with fp8train.autocast():
        out = model(x)
    out.square().mean().backward()


def _assert_second_step_syncs_nothing(model: torch.nn.Module) -> None:
    assert isinstance(model[0], fp8train.Float8Linear) and isinstance(model[2], fp8train.Float8Linear)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    with use_quant_settings(quantize_kernel="reference"):
        _step(model, x)  # may build and cache its constants
        assert_no_host_syncs(lambda: _step(model, x))


def test_recipe_names_are_the_eight_pinned_here():
    assert set(RECIPE_NAMES) == {
        "tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8", "nvfp4", "mxfp4"
    }  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_training_step_syncs_nothing(small_model, recipe):
    _assert_second_step_syncs_nothing(small_model(*LAYERS, recipe=recipe))


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8", "nvfp4", "mxfp4"])
def test_step_with_a_frozen_weight_stored_in_fp8_syncs_nothing(small_model, recipe):
    model = small_model(*LAYERS, recipe=recipe)
    model[0].weight.requires_grad_(False)
    assert fp8train.store_frozen_weights_in_fp8(model) == ["0"]
    _assert_second_step_syncs_nothing(model)



def _distributed_worker(rank: int, results, small_model) -> None:
    model = small_model(*LAYERS, recipe="delayed")
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(rank))
    with use_quant_settings(quantize_kernel="reference"):
        _step(model, x)
        with HostSyncRecorder() as recorder:
            _step(model, x)  # its update: one batched all-reduce of every state's amaxes
    results[rank] = [str(event) for event in recorder.events]


@pytest.mark.heavy  # multi-process: moved out of the README's command to keep it under 6 minutes (CI's second leg runs it)
def test_distributed_delayed_step_syncs_nothing(spawn_gloo, small_model):
    """gloo, 2 processes: the batched amax all-reduce and the updates after it."""
    results = spawn_gloo(_distributed_worker, small_model, world_size=2, timeout=120)
    assert results == {0: [], 1: []}


def test_moe_routing_reads_only_its_counts_on_the_host():
    """Float8Experts' routing: the tokens per expert are read once on the host (inherent:
    the loop over experts and the splits take them); the padding stays on the device."""
    top_k_index = torch.tensor([[0, 2], [2, 3], [0, 4]])  # expert 4: parallelism's sentinel
    with HostSyncRecorder() as recorder:
        routes = ExpertRoutes(top_k_index, num_experts=4, alignment=16)
    assert [(event.kind, event.op) for event in recorder.events] == [(HOST_READ, "tolist")]
    assert routes.counts == [2, 0, 2, 1] and routes.padded_counts == [16, 0, 16, 16]
    assert routes.padded_position.tolist() == [0, 1, 16, 17, 32]
