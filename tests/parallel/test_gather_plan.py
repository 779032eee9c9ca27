"""What FSDP2 gathers in FP8 (or 4 bits) for each recipe, as the recipe's plan decides it."""

import pytest

from fp8train.parallel import gather_plan, supports_fp8_all_gather
from fp8train.spec import Granularity, Role, Usage
from fp8train.spec.recipes import BlockScaling, TensorwiseScaling, from_name

G = Granularity
# recipe: None (high-precision gather) or (rowwise granularity, columnwise granularity or
# None when the transpose serves, rows each shard must hold whole, per-tensor scale)
EXPECTED = {
    "tensorwise": (G.TENSOR, None, 1, True),
    "delayed": (G.TENSOR, None, 1, True),
    "rowwise": None,  # the grad_input GEMM's per-column weight scales span every row
    "rowwise_with_gw_hp": None,  # one per-tensor scale beside per-row ones
    "blockwise": (G.BLOCK_128X128, None, 128, False),
    "mxfp8": (G.MX, G.MX, 32, False),
    "nvfp4": (G.NVFP4_2D, None, 16, False),  # 16x16 tiles, under the MAX of the shards' global amaxes
    "mxfp4": (G.MXFP4, G.MXFP4, 32, False),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_gather_plan_per_recipe(name):
    gather = gather_plan(from_name(name))
    assert supports_fp8_all_gather(from_name(name)) is (EXPECTED[name] is not None)
    if EXPECTED[name] is None:
        assert gather is None
        return
    rowwise, columnwise, rows, per_tensor = EXPECTED[name]
    assert gather.rowwise.usage is Usage.OUTPUT_WEIGHT and gather.rowwise.granularity is rowwise
    assert (gather.columnwise.granularity if gather.columnwise else None) is columnwise
    assert gather.rows_multiple == rows
    assert gather.per_tensor is per_tensor
    assert gather.plan.delayed is (name == "delayed")


def test_one_dimensional_weight_blocks_gather_a_columnwise_copy():
    gather = gather_plan(BlockScaling(w_block_scaling_dim=1))
    assert gather.rowwise.granularity is G.BLOCK_1X128 and gather.rowwise.axis == -1
    assert gather.columnwise.usage is Usage.GRAD_INPUT_WEIGHT and gather.columnwise.axis == 0
    assert gather.rows_multiple == 128  # 1-row groups for one usage, 128-row for the other


def test_power_2_tensorwise_keeps_its_scale_setting():
    gather = gather_plan(TensorwiseScaling(power_2_scales=True, amax_epsilon=1e-4))
    assert gather.rowwise.power_2_scales and gather.rowwise.rule.amax_epsilon == 1e-4


def test_4bit_weights_gather_packed_codes_with_their_block_scales():
    from fp8train.spec import NVFP4Scaling

    # NVFP4's 16x16 tiles: the transpose serves grad_input; shards of whole 16-row tiles.
    gather = gather_plan(from_name("nvfp4"))
    assert gather.rowwise.granularity is G.NVFP4_2D and gather.columnwise is None
    assert gather.rows_multiple == 16 and gather.global_amax and not gather.per_tensor
    # 1x16 weights: a 16x1 columnwise copy of its own.
    gather = gather_plan(NVFP4Scaling(disable_2d_quantization=True))
    assert gather.rowwise.granularity is G.NVFP4 and gather.columnwise.granularity is G.NVFP4
    assert gather.columnwise.axis == 0 and gather.rows_multiple == 16
    # MXFP4: 1x32 and 32x1, no global amax.
    gather = gather_plan(from_name("mxfp4"))
    assert (gather.rowwise.granularity, gather.columnwise.granularity) == (G.MXFP4, G.MXFP4)
    assert gather.rows_multiple == 32 and not gather.global_amax


def test_4bit_activations_gather_with_their_own_transformed_columnwise_copy():
    from fp8train.spec import Role

    for role in (Role.INPUT, Role.GRAD_OUTPUT):
        gather = gather_plan(from_name("nvfp4"), role)
        assert gather.rowwise.axis == -1 and not gather.rowwise.rule.rht
        assert gather.columnwise.axis == 0 and gather.columnwise.rule.rht  # the grad_weight GEMM's
        assert gather.rows_multiple == 16 and gather.global_amax


def test_a_mixture_gathers_in_fp8_only_where_its_two_weight_slots_are_one_quantization():
    """tensorwise forward, delayed backward: the weight's two per-tensor slots take two
    scales (its own amax's, the history's), so the transpose of one gathered copy cannot
    serve both: high precision. A mixture whose weight slots share a rule gathers as the
    recipe does."""
    from fp8train.spec.recipes import hybrid

    assert gather_plan(hybrid(forward="tensorwise", backward="delayed")) is None
    assert gather_plan(hybrid(forward="delayed", backward="tensorwise")) is None
    assert gather_plan(hybrid(forward="delayed", backward="mxfp8")) is None  # per-tensor beside mx
    same = gather_plan(hybrid(forward="delayed", backward="delayed"))
    assert same is not None and same.delayed and same.columnwise is None
    grad_output = gather_plan(hybrid(forward="delayed", backward="mxfp8"), Role.GRAD_OUTPUT)
    assert grad_output is not None and not grad_output.delayed  # mxfp8's own scales, not the state's
