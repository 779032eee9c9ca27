"""The 4-bit weight all-gather of FSDP2, in one process: each shard's pre-all-gather
payload (packed E2M1 codes, block scales; NVFP4 under the MAX of the shards' global
amaxes), concatenated as the all-gather concatenates it, assembled by the post-all-gather
hook, against quantizing the whole weight in one process, bit for bit. The collectives
themselves run in tests/parallel/test_fsdp.py and test_tensor_parallel.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import fp8train
from fp8train.parallel import Float8AllGatherWeight, gather_plan
from fp8train.parallel.gather import global_amaxes
from fp8train.quant.prequantized import PrequantizedTensor
from fp8train.quant.quantize import quantize
from fp8train.spec import NVFP4Scaling, Role
from fp8train.spec.recipes import from_name

NUM_SHARDS = 2
RECIPES = {"nvfp4": "nvfp4", "nvfp4_1x16": NVFP4Scaling(disable_2d_quantization=True), "mxfp4": "mxfp4"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (4-bit data viewed as bytes first: PyTorch copies no transposed 4-bit tensor)."""
    if t.element_size() == 1:
        return t.view(torch.uint8).contiguous().reshape(-1)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _weight() -> torch.Tensor:
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    weight[50, 7] = 300.0  # in the second shard only: the first must take it from the reduction
    return weight


def _gathered(recipe, weight: torch.Tensor, reduce: bool = True, param_dtype=None) -> PrequantizedTensor:
    """``weight`` through FSDP2's hooks over :data:`NUM_SHARDS` row shards, the all-gather
    (a concatenation along dim 0) and its MAX all-reduce of the global amaxes done here (as
    ``precompute_fp8_scales_for_fsdp`` hands them over, from the stored weight); FSDP2's
    mixed-precision ``param_dtype`` where given."""
    module = fp8train.Float8Linear(weight.shape[1], weight.shape[0], recipe=recipe)
    gather = gather_plan(module.recipe)
    shards = [Float8AllGatherWeight(s) for s in weight.chunk(NUM_SHARDS)]
    if gather.global_amax and reduce:
        local = [global_amaxes([s.high_precision()], [gather], None)[0] for s in shards]
        reduced = tuple(
            None if parts[0] is None else torch.stack(parts).amax() for parts in zip(*local)
        )
        for shard in shards:
            shard.precompute(global_amax=reduced)
    mp_policy = None if param_dtype is None else SimpleNamespace(param_dtype=param_dtype)
    payloads = [s.fsdp_pre_all_gather(None, weight.shape, weight.stride(), module, mp_policy) for s in shards]
    outputs = tuple(torch.cat(parts) for parts in zip(*(inputs for inputs, _ in payloads)))
    if reduce:  # every shard quantized under the same global amax
        assert len({repr(metadata[-1]) for _, metadata in payloads}) == 1
    gathered, _ = shards[0].fsdp_post_all_gather(outputs, payloads[0][1], param_dtype or weight.dtype)
    return gathered


@pytest.mark.parametrize("name", list(RECIPES))
def test_gathered_4bit_weight_is_bit_equal_to_quantizing_the_whole_weight(name):
    weight = _weight()
    gathered = _gathered(RECIPES[name], weight)
    gather = gather_plan(fp8train.Float8Linear(96, 64, recipe=RECIPES[name]).recipe)
    assert isinstance(gathered, PrequantizedTensor) and gathered.shape == (64, 96)
    expected = quantize(weight, gather.rowwise.rule, axis=-1)
    rowwise = gathered.fp8_rowwise
    assert rowwise.data.dtype == torch.float4_e2m1fn_x2 and rowwise.data.shape == (64, 48)
    assert torch.equal(_bits(rowwise.data), _bits(expected.data))
    assert torch.equal(_bits(rowwise.scale_inv), _bits(expected.scale_inv))
    if name == "mxfp4":
        assert rowwise.global_amax is None
    else:
        assert rowwise.global_amax.item() == 300.0 and torch.equal(rowwise.global_amax, expected.global_amax)
    # The grad_input GEMM's K-last operand: the transpose of the 16x16 tiles, or its own.
    if gather.columnwise is None:
        assert gathered.fp8_columnwise is None
    else:
        own = quantize(weight, gather.columnwise.rule, axis=0)
        columnwise = gathered.fp8_columnwise
        assert columnwise.axis == -1 and columnwise.data.shape == (96, 32)
        assert torch.equal(_bits(columnwise.data), _bits(own.data.t()))
        assert torch.equal(_bits(columnwise.scale_inv), _bits(own.scale_inv.t()))
        assert (columnwise.global_amax is None) == (own.global_amax is None)
    # Its high-precision face is the dequantized weight, of the weight's shape.
    torch.testing.assert_close(gathered * 1, expected.dequantize())


def test_a_bfloat16_gather_quantizes_the_cast_weight_under_its_amax():
    # The global amax was reduced from the float32 weight; the shards are cast to bfloat16
    # first, whose amax is the float32 amax rounded (rounding is monotonic).
    weight = _weight()
    weight[50, 7] = 300.03  # not a bfloat16 value: its amax rounds
    gathered = _gathered("nvfp4", weight, param_dtype=torch.bfloat16)
    expected = quantize(weight.bfloat16(), gather_plan(from_name("nvfp4")).rowwise.rule)
    assert gathered.dtype == torch.bfloat16
    assert torch.equal(gathered.fp8_rowwise.global_amax, expected.global_amax) and expected.global_amax != 300.03
    assert torch.equal(_bits(gathered.fp8_rowwise.data), _bits(expected.data))
    assert torch.equal(_bits(gathered.fp8_rowwise.scale_inv), _bits(expected.scale_inv))


def test_without_the_reduction_the_shards_scales_differ():
    # What the MAX all-reduce is for: each shard under its own global amax is another quantization.
    weight = _weight()
    alone = _gathered("nvfp4", weight, reduce=False).fp8_rowwise
    expected = quantize(weight, gather_plan(from_name("nvfp4")).rowwise.rule)
    assert not torch.equal(_bits(alone.scale_inv), _bits(expected.scale_inv))


def test_global_amaxes_reduce_each_usage_after_its_transform_and_keep_nan():
    recipe = from_name("nvfp4")
    gather = gather_plan(recipe, Role.INPUT)  # rowwise 1x16, columnwise 16x1 through the transform
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    (rowwise, columnwise), = global_amaxes([x], [gather], None)
    assert torch.equal(rowwise, quantize(x, gather.rowwise.rule).global_amax)
    assert torch.equal(columnwise, quantize(x, gather.columnwise.rule, axis=0).global_amax)
    assert not torch.equal(rowwise, columnwise)
    x[3, 3] = math.nan
    (rowwise, columnwise), = global_amaxes([x], [gather], None)
    assert rowwise.isnan() and columnwise.isnan()


def test_global_amaxes_of_several_tensors_are_each_their_own():
    # One all-reduce for a batch of tensors (precompute_fp8_scales_for_fsdp): each tensor's
    # pair is its own, whether the tensors before it gather a columnwise copy or not.
    recipe = from_name("nvfp4")
    with_columnwise, weight = gather_plan(recipe, Role.INPUT), gather_plan(recipe)
    assert with_columnwise.columnwise is not None and weight.columnwise is None
    gathers = [with_columnwise, with_columnwise, weight, with_columnwise]
    shards = [torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)) * (seed + 1) for seed in range(4)]
    batched = global_amaxes(shards, gathers, None)
    for shard, gather, (rowwise, columnwise) in zip(shards, gathers, batched, strict=True):
        alone_rowwise, alone_columnwise = global_amaxes([shard], [gather], None)[0]
        assert torch.equal(rowwise, alone_rowwise)
        assert (columnwise is None) == (alone_columnwise is None) == (gather.columnwise is None)
        assert columnwise is None or torch.equal(columnwise, alone_columnwise)


def test_a_prequantized_4bit_activation_keeps_its_payload_through_reshapes():
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(6))
    qt = quantize(x, gather_plan(from_name("nvfp4"), Role.INPUT).rowwise.rule)
    activation = PrequantizedTensor(qt, None, torch.float32)
    assert activation.shape == (2, 32, 64)
    flat = activation.reshape(-1, 64)
    assert isinstance(flat, PrequantizedTensor) and flat.fp8_rowwise.data.shape == (64, 32)
    assert flat.fp8_rowwise.global_amax is qt.global_amax
    torch.testing.assert_close(flat * 1, qt.dequantize().reshape(-1, 64))


@pytest.mark.parametrize("name, rows", [("nvfp4", 16), ("mxfp4", 32)])
def test_weights_whose_shards_split_a_scaling_group_gather_in_high_precision(caplog, name, rows):
    # 64 rows over 8 ranks: 8 rows per shard, less than a 16x16 tile or a 32-row MXFP4 group.
    import logging

    from torch import nn

    from fp8train.parallel import enable_fp8_all_gather

    model = nn.Sequential(fp8train.Float8Linear(64, 64, recipe=name), fp8train.Float8Linear(64, 256, recipe=name))
    with caplog.at_level(logging.INFO, logger="fp8train.parallel.fsdp"):
        enable_fp8_all_gather(model, shard_world_size=8)
    assert [isinstance(m.weight, Float8AllGatherWeight) for m in model] == [False, (256 // 8) % rows == 0]
    assert f"out_features=64 over 8 ranks does not give whole {rows}-row {name} blocks" in caplog.text


def test_activation_shards_that_split_a_scaling_group_gather_in_high_precision():
    from fp8train.parallel.sequence_gather import activation_gather_plan

    recipe = from_name("nvfp4")
    gather, reason = activation_gather_plan(recipe, Role.INPUT, (2, 8, 64), 1, 2)
    assert gather is None and "8 consecutive tokens, not whole 16-token scaling groups" in reason
    gather, _ = activation_gather_plan(recipe, Role.GRAD_OUTPUT, (2, 16, 64), 1, 2)
    assert gather is not None and gather.global_amax
    gather, reason = activation_gather_plan(from_name("mxfp4"), Role.INPUT, (2, 16, 64), 1, 2)
    assert gather is None and "not whole 32-token scaling groups" in reason
