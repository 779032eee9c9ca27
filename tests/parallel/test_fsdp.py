"""FSDP2 (fully_shard) with FP8 all-gather, on 2 CPU processes over gloo (spawned by the
``spawn_gloo`` fixture; workers get the ``small_model`` builder as an argument)."""

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import fp8train
from fp8train.parallel import Float8AllGatherWeight, enable_fp8_all_gather, precompute_fp8_scales_for_fsdp

from ..helpers.sharded_steps import sharded_sgd_losses

WORLD_SIZE = 2
TIMEOUT_SECONDS = 180
STEPS = 3
# Loss per step, FSDP2 (2 x 32 rows) vs one process (64 rows). delayed, blockwise, mxfp8:
# the same scales and FP8 codes, only float32 summation order differs. tensorwise: each
# rank scales its own activations (current scaling), so quantization differs a little.
LOSS_RTOL = {"delayed": 1e-5, "blockwise": 1e-5, "mxfp8": 1e-5, "tensorwise": 2e-2, "rowwise": 1e-5}
# 4-bit: the gathered weights are one process's (tested bit for bit). MXFP4's activation
# groups are local to a rank's 32 rows: only summation order differs. NVFP4: each rank
# quantizes its own batch shard under its own global amax (data parallelism shares no
# activations) and draws its own stochastic rounding of grad_output (measured: 2e-3).
LOSS_RTOL_4BIT = {"nvfp4": 5e-3, "mxfp4": 1e-5}


def _model(small_model, recipe: str, out_features: int = 256) -> nn.Module:
    return small_model((128, 256), "gelu", (256, out_features), recipe=recipe, backend="emulated")


def _train(model: nn.Module, shard, world: int, use_autocast: bool = True) -> list[float]:
    """SGD steps on ``shard`` of each batch (:func:`tests.helpers.sharded_steps.sharded_sgd_losses`),
    the FP8 weight scales precomputed after each step under FSDP2."""
    batches = []
    for step in range(STEPS):
        x = torch.randn(64, 128, generator=torch.Generator().manual_seed(step))
        x[32:] *= 3
        batches.append(x)
    after_step = precompute_fp8_scales_for_fsdp if world > 1 else None
    return sharded_sgd_losses(model, batches, shard, 32 * 256, world, WORLD_SIZE, after_step, use_autocast)


def _payload_bits(qt) -> list[torch.Tensor]:
    """The bytes of a quantized weight's data, scales and (NVFP4) global amax (copies: FSDP2
    reuses its all-gather buffers)."""
    parts = [qt.data, qt.scale_inv] + ([] if qt.global_amax is None else [qt.global_amax])
    return [t.contiguous().reshape(-1).view(torch.uint8).clone() for t in parts]


def _worker(rank: int, results, small_model, recipe: str, out_features: int, use_autocast: bool = True) -> None:
    warnings.filterwarnings("ignore")
    gathered, first_gathered = [], []
    original, original_post = Float8AllGatherWeight.fsdp_pre_all_gather, Float8AllGatherWeight.fsdp_post_all_gather

    def spy(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2 inspects this signature
        inputs, metadata = original(self, mesh, outer_size, outer_stride, module, mp_policy)
        gathered.append([(t.dtype, t.numel()) for t in inputs] + [("shard", self.numel())])
        return inputs, metadata

    def spy_post(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        result = original_post(self, all_gather_outputs, metadata, param_dtype, out=out)
        if out is None:  # the first gather of each weight: its unsharded tensor
            first_gathered.append(_payload_bits(result[0].fp8_rowwise))
        return result

    Float8AllGatherWeight.fsdp_pre_all_gather = spy
    Float8AllGatherWeight.fsdp_post_all_gather = spy_post
    try:
        model = enable_fp8_all_gather(_model(small_model, recipe, out_features))
        wrapped = [isinstance(layer.weight, Float8AllGatherWeight) for layer in model if isinstance(layer, nn.Linear)]
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        losses = _train(model, lambda x: x[32 * rank : 32 * (rank + 1)], WORLD_SIZE, use_autocast)
        with fp8train.autocast(enabled=False):  # high-precision evaluation still works
            evaluation = model(torch.ones(4, 128)).sum().item()
        results[rank] = {
            "losses": losses, "gathered": gathered, "wrapped": wrapped, "eval": evaluation, "first": first_gathered,
            "buffers": [b.detach().clone() for b in model.buffers()],
        }
    finally:
        Float8AllGatherWeight.fsdp_pre_all_gather = original
        Float8AllGatherWeight.fsdp_post_all_gather = original_post


def _spawn(spawn_gloo, small_model, recipe: str, out_features: int = 256, use_autocast: bool = True) -> dict:
    return spawn_gloo(
        _worker, small_model, recipe, out_features, use_autocast, world_size=WORLD_SIZE, timeout=TIMEOUT_SECONDS
    )


@pytest.mark.heavy
def test_fsdp2_delayed_state_stays_identical_without_autocast(spawn_gloo, small_model):
    """A loop fp8train does not own (no ``fp8train.autocast``): every rank's scales and
    histories stay identical and equal to one process on the whole batch."""
    results = _spawn(spawn_gloo, small_model, "delayed", use_autocast=False)
    reference_model = _model(small_model, "delayed")
    reference = _train(reference_model, lambda x: x, 1, use_autocast=False)
    assert results[0]["losses"] == results[1]["losses"]
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(reference), rtol=LOSS_RTOL["delayed"], atol=0)
    for buffer_0, buffer_1, expected in zip(results[0]["buffers"], results[1]["buffers"], reference_model.buffers()):
        assert torch.equal(buffer_0, buffer_1)
        assert torch.equal(buffer_0, expected)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "recipe",
    ["delayed", pytest.param("mxfp8", marks=pytest.mark.slow), pytest.param("blockwise", marks=pytest.mark.slow), pytest.param("tensorwise", marks=pytest.mark.slow)],
)
def test_fsdp2_fp8_all_gather_matches_one_process(recipe, spawn_gloo, small_model):
    results = _spawn(spawn_gloo, small_model, recipe)
    reference = _train(_model(small_model, recipe), lambda x: x, 1)
    assert results[0]["losses"] == results[1]["losses"]
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(reference), rtol=LOSS_RTOL[recipe], atol=0)
    assert all(results[0]["wrapped"])
    # The all-gather moves FP8 bytes: 1 byte per weight element (uint8 views of the FP8
    # data), plus small scales for the block recipes (and MXFP8's columnwise copy).
    for inputs in results[0]["gathered"]:
        *payload, (_, shard_numel) = inputs
        assert payload[0] == (torch.uint8, shard_numel)
        assert all(dtype == torch.uint8 for dtype, _ in payload)
        scale_bytes = sum(numel for _, numel in payload[1:]) - (shard_numel if recipe == "mxfp8" else 0)
        assert scale_bytes < shard_numel / 8
    assert results[0]["eval"] == pytest.approx(results[1]["eval"])


# Spawned ranks (~4 s each): under -m slow; the gather's plan and shard quantization run by
# default in one process (test_gather_4bit.py), as does the tensor-parallel 4-bit gather.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_fsdp2_4bit_all_gather_is_one_process_quantization(recipe, spawn_gloo, small_model):
    from fp8train.parallel import gather_plan
    from fp8train.quant.quantize import quantize

    results = _spawn(spawn_gloo, small_model, recipe)
    # The first forward's gathered weights, on every rank: the packed codes, block scales and
    # global amax of quantizing each whole weight in one process.
    model = _model(small_model, recipe)
    rule = gather_plan(model[0].recipe).rowwise.rule
    expected = [_payload_bits(quantize(m.weight.detach(), rule)) for m in model if isinstance(m, nn.Linear)]
    for rank in range(WORLD_SIZE):
        assert len(results[rank]["first"]) == len(expected)
        for got, want in zip(results[rank]["first"], expected):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert results[0]["losses"] == results[1]["losses"] and all(results[0]["wrapped"])
    reference = _train(_model(small_model, recipe), lambda x: x, 1)
    torch.testing.assert_close(
        torch.tensor(results[0]["losses"]), torch.tensor(reference), rtol=LOSS_RTOL_4BIT[recipe], atol=0
    )
    # Half a byte per weight element (twice for MXFP4's columnwise copy), plus small scales.
    for inputs in results[0]["gathered"]:
        *payload, (_, shard_numel) = inputs
        copies = 2 if recipe == "mxfp4" else 1
        assert all(dtype == torch.uint8 for dtype, _ in payload)
        assert [numel for _, numel in payload[::2]] == [shard_numel // 2] * copies
        assert sum(numel for _, numel in payload[1::2]) <= copies * shard_numel / 16


@pytest.mark.heavy
def test_rowwise_falls_back_to_a_high_precision_gather(caplog, spawn_gloo, small_model):
    with caplog.at_level(logging.INFO, logger="fp8train.parallel.fsdp"):
        model = enable_fp8_all_gather(_model(small_model, "rowwise"))
    assert not any(isinstance(m.weight, Float8AllGatherWeight) for m in model if isinstance(m, nn.Linear))
    assert "gathers rowwise weights in high precision" in caplog.text
    results = _spawn(spawn_gloo, small_model, "rowwise")
    reference = _train(_model(small_model, "rowwise"), lambda x: x, 1)
    assert results[0]["gathered"] == []
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(reference), rtol=LOSS_RTOL["rowwise"], atol=0)


def test_blockwise_layers_without_whole_blocks_per_shard_gather_in_high_precision(caplog, small_model):
    # out_features=128 over 2 ranks: 64 rows per shard, half a 128x128 block.
    with caplog.at_level(logging.INFO, logger="fp8train.parallel.fsdp"):
        model = enable_fp8_all_gather(_model(small_model, "blockwise", out_features=128), shard_world_size=2)
    assert [isinstance(m.weight, Float8AllGatherWeight) for m in model if isinstance(m, nn.Linear)] == [True, False]
    assert "out_features=128 over 2 ranks" in caplog.text and "multiple of 256" in caplog.text


@pytest.mark.slow  # about 5 s: test_rowwise_falls_back_to_a_high_precision_gather trains a fallback by default
def test_blockwise_layers_without_whole_blocks_per_shard_train_as_one_process(spawn_gloo, small_model):
    results = _spawn(spawn_gloo, small_model, "blockwise", out_features=128)
    reference = _train(_model(small_model, "blockwise", out_features=128), lambda x: x, 1)
    assert results[0]["wrapped"] == [True, False]
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(reference), rtol=1e-5, atol=0)


def test_wrapped_weight_behaves_as_its_tensor():
    weight = Float8AllGatherWeight(torch.arange(6.0).reshape(2, 3))
    assert torch.equal(weight * 2, torch.arange(6.0).reshape(2, 3) * 2)
    assert isinstance(weight.detach(), Float8AllGatherWeight)
    assert isinstance(weight.view(3, 2), Float8AllGatherWeight)
    weight.mul_(0)  # optimizers update it in place
    assert torch.equal(weight._tensor, torch.zeros(2, 3))


@pytest.mark.heavy
def test_fsdp2_gathers_a_mixtures_two_weight_slots_in_fp8_and_matches_one_process(spawn_gloo, small_model):
    """hybrid(forward=mxfp8, backward=blockwise) (issue 41): the weight's MX rowwise copy and its
    own 128x128-block columnwise copy both travel in FP8; the losses are one process's up to
    float32 summation order, as for the plain recipes."""
    recipe = "hybrid(forward=mxfp8,backward=blockwise)"
    results = _spawn(spawn_gloo, small_model, recipe)
    reference = _train(_model(small_model, recipe), lambda x: x, 1)
    assert results[0]["losses"] == results[1]["losses"]
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(reference), rtol=1e-5, atol=0)
    assert all(results[0]["wrapped"])
    for inputs in results[0]["gathered"]:
        *payload, (_, shard_numel) = inputs
        assert all(dtype == torch.uint8 for dtype, _ in payload)
        assert sum(numel for _, numel in payload) < 2.2 * shard_numel  # two FP8 copies and their scales
