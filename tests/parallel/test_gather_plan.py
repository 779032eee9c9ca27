"""What FSDP2 gathers in FP8 for each recipe, as the recipe's plan decides it."""

import pytest

from fp8train.parallel import gather_plan, supports_fp8_all_gather
from fp8train.spec import Granularity, Usage
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


def test_4bit_weights_gather_in_high_precision():
    # No 4-bit recipe exists yet; a plan of 4-bit slots (NVFP4's: 2-D weight tiles) is enough.
    from types import SimpleNamespace

    from fp8train.spec import OperandPlan, Role
    from fp8train.spec.formats import E2M1

    roles = {Role.INPUT: Granularity.NVFP4, Role.WEIGHT: Granularity.NVFP4_2D, Role.GRAD_OUTPUT: Granularity.NVFP4}
    plan = OperandPlan.from_roles(roles, dict.fromkeys(Role, E2M1), power_2_scales=False)
    assert plan.reuses_last_dim(Usage.GRAD_INPUT_WEIGHT)  # 16x16 tiles: the transpose serves
    recipe = SimpleNamespace(operand_plan=plan)
    assert gather_plan(recipe) is None and gather_plan(recipe, Role.INPUT) is None
